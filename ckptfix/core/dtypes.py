"""The one dtype table: safetensors name, bits, kind, torch names and legacy storage class."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    COMPLEX = "complex"


@dataclass(frozen=True)
class DType:
    name: str  # the safetensors name, e.g. "BF16"
    bits: int
    kind: Kind
    torch: tuple[str, ...] = ()  # torch attribute names, canonical first
    storage: str | None = None  # the legacy typed storage class, e.g. "BFloat16Storage"

    @property
    def is_floating(self) -> bool:
        return self.kind is Kind.FLOAT

    @property
    def unsigned(self) -> str | None:
        """The numpy unsigned integer of the same width: for moving and comparing raw
        elements without interpreting them (None below one byte)."""
        return {8: "u1", 16: "<u2", 32: "<u4", 64: "<u8", 128: "V16"}.get(self.bits)


_ROWS = [
    DType("BOOL", 8, Kind.BOOL, ("bool",), "BoolStorage"),
    DType("U8", 8, Kind.INT, ("uint8",), "ByteStorage"),
    DType("I8", 8, Kind.INT, ("int8",), "CharStorage"),
    DType("F8_E5M2", 8, Kind.FLOAT, ("float8_e5m2",)),
    DType("F8_E4M3", 8, Kind.FLOAT, ("float8_e4m3fn",)),
    DType("F8_E8M0", 8, Kind.FLOAT, ("float8_e8m0fnu",)),
    DType("F8_E4M3FNUZ", 8, Kind.FLOAT, ("float8_e4m3fnuz",)),
    DType("F8_E5M2FNUZ", 8, Kind.FLOAT, ("float8_e5m2fnuz",)),
    DType("I16", 16, Kind.INT, ("int16", "short"), "ShortStorage"),
    DType("U16", 16, Kind.INT, ("uint16",)),
    DType("F16", 16, Kind.FLOAT, ("float16", "half"), "HalfStorage"),
    DType("BF16", 16, Kind.FLOAT, ("bfloat16",), "BFloat16Storage"),
    DType("I32", 32, Kind.INT, ("int32", "int"), "IntStorage"),
    DType("U32", 32, Kind.INT, ("uint32",)),
    DType("F32", 32, Kind.FLOAT, ("float32", "float"), "FloatStorage"),
    DType("F64", 64, Kind.FLOAT, ("float64", "double"), "DoubleStorage"),
    DType("I64", 64, Kind.INT, ("int64", "long"), "LongStorage"),
    DType("U64", 64, Kind.INT, ("uint64",)),
    DType("C64", 64, Kind.COMPLEX, ("complex64", "cfloat"), "ComplexFloatStorage"),
    DType("F4", 4, Kind.FLOAT),
    DType("F6_E2M3", 6, Kind.FLOAT),
    DType("F6_E3M2", 6, Kind.FLOAT),
]

DTYPES: dict[str, DType] = {row.name: row for row in _ROWS}
# torch attribute (e.g. "half") -> safetensors name
TORCH_DTYPES: dict[str, str] = {alias: row.name for row in _ROWS for alias in row.torch}
# legacy typed storage class -> safetensors name
TORCH_STORAGES: dict[str, str] = {row.storage: row.name for row in _ROWS if row.storage}
# safetensors name -> canonical torch attribute
TORCH_NAMES: dict[str, str] = {row.name: row.torch[0] for row in _ROWS if row.torch}


def byte_size(dtype: DType, numel: int) -> int | None:
    """Bytes taken by `numel` elements, or None when that is not a whole number of bytes."""
    bits = numel * dtype.bits
    if bits % 8:
        return None
    return bits // 8


def numel_of(shape: tuple[int, ...]) -> int:
    """Element count in exact (Python) integers: never overflows the way int32/int64 products do."""
    count = 1
    for dim in shape:
        count *= dim
    return count
