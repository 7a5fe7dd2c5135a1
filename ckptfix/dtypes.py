"""The safetensors dtype table: bits per element and what kind of number each holds."""

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
    name: str
    bits: int
    kind: Kind

    @property
    def is_floating(self) -> bool:
        return self.kind is Kind.FLOAT


def _table() -> dict[str, DType]:
    rows = [
        ("BOOL", 8, Kind.BOOL),
        ("U8", 8, Kind.INT),
        ("I8", 8, Kind.INT),
        ("F8_E5M2", 8, Kind.FLOAT),
        ("F8_E4M3", 8, Kind.FLOAT),
        ("F8_E8M0", 8, Kind.FLOAT),
        ("F8_E4M3FNUZ", 8, Kind.FLOAT),
        ("F8_E5M2FNUZ", 8, Kind.FLOAT),
        ("I16", 16, Kind.INT),
        ("U16", 16, Kind.INT),
        ("F16", 16, Kind.FLOAT),
        ("BF16", 16, Kind.FLOAT),
        ("I32", 32, Kind.INT),
        ("U32", 32, Kind.INT),
        ("F32", 32, Kind.FLOAT),
        ("F64", 64, Kind.FLOAT),
        ("I64", 64, Kind.INT),
        ("U64", 64, Kind.INT),
        ("C64", 64, Kind.COMPLEX),
        ("F4", 4, Kind.FLOAT),
        ("F6_E2M3", 6, Kind.FLOAT),
        ("F6_E3M2", 6, Kind.FLOAT),
    ]
    return {name: DType(name, bits, kind) for name, bits, kind in rows}


DTYPES: dict[str, DType] = _table()


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
