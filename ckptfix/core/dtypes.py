"""The one dtype table: safetensors name, bits, kind, torch names and legacy storage class;
and ggml's block-quantized types (GGUF), named as ggml names them, whose bytes are counted by
blocks: `elements / block * block_bytes`, never `elements * bits / 8`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

U64_MAX = 2**64 - 1  # the largest size, offset or dimension a file format can state


class Kind(str, Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    COMPLEX = "complex"
    QUANTIZED = "quantized"  # ggml block quantization: no bits per element


@dataclass(frozen=True)
class DType:
    """A tensor element type: its safetensors name, its width and its kind."""

    name: str  # the safetensors name, e.g. "BF16"
    bits: int
    kind: Kind
    torch: tuple[str, ...] = ()  # torch attribute names, canonical first
    storage: str | None = None  # the legacy typed storage class, e.g. "BFloat16Storage"
    block: int = 1  # elements per block (block-quantized types only)
    block_bytes: int = 0  # bytes per block (block-quantized types only; bits is 0 for them)

    @property
    def quantized(self) -> bool:
        return self.kind is Kind.QUANTIZED

    @property
    def is_floating(self) -> bool:
        return self.kind is Kind.FLOAT

    @property
    def unsigned(self) -> str | None:
        """The numpy unsigned integer of the same width: for moving and comparing raw
        elements without interpreting them (None below one byte, and for block types)."""
        return {8: "u1", 16: "<u2", 32: "<u4", 64: "<u8", 128: "V16"}.get(self.bits)

    @property
    def unit(self) -> int:
        """The bytes a reader must never split: one block of a quantized type, one element
        of a whole-byte type, one byte below that."""
        if self.quantized:
            return self.block_bytes
        return max(self.bits // 8, 1)


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


def _quantized(name: str, block: int, block_bytes: int) -> DType:
    return DType(name, 0, Kind.QUANTIZED, block=block, block_bytes=block_bytes)


# ggml's block-quantized types with (elements, bytes) per block, as ggml and gguf-py's
# GGML_QUANT_SIZES give them (tests/test_gguf_types.py checks this table against gguf-py's).
_QUANTIZED = [
    _quantized("Q4_0", 32, 18),
    _quantized("Q4_1", 32, 20),
    _quantized("Q5_0", 32, 22),
    _quantized("Q5_1", 32, 24),
    _quantized("Q8_0", 32, 34),
    _quantized("Q8_1", 32, 40),
    _quantized("Q2_K", 256, 84),
    _quantized("Q3_K", 256, 110),
    _quantized("Q4_K", 256, 144),
    _quantized("Q5_K", 256, 176),
    _quantized("Q6_K", 256, 210),
    _quantized("Q8_K", 256, 292),
    _quantized("IQ2_XXS", 256, 66),
    _quantized("IQ2_XS", 256, 74),
    _quantized("IQ3_XXS", 256, 98),
    _quantized("IQ1_S", 256, 50),
    _quantized("IQ4_NL", 32, 18),
    _quantized("IQ3_S", 256, 110),
    _quantized("IQ2_S", 256, 82),
    _quantized("IQ4_XS", 256, 136),
    _quantized("IQ1_M", 256, 56),
    _quantized("TQ1_0", 256, 54),
    _quantized("TQ2_0", 256, 66),
    _quantized("MXFP4", 32, 17),
    _quantized("NVFP4", 64, 36),
    _quantized("Q1_0", 128, 18),
]

# What a safetensors header may name: every dtype but ggml's block types.
SAFETENSORS_DTYPES: dict[str, DType] = {row.name: row for row in _ROWS}
DTYPES: dict[str, DType] = {**SAFETENSORS_DTYPES, **{row.name: row for row in _QUANTIZED}}
# torch attribute (e.g. "half") -> safetensors name
TORCH_DTYPES: dict[str, str] = {alias: row.name for row in _ROWS for alias in row.torch}
# legacy typed storage class -> safetensors name
TORCH_STORAGES: dict[str, str] = {row.storage: row.name for row in _ROWS if row.storage}
# safetensors name -> canonical torch attribute
TORCH_NAMES: dict[str, str] = {row.name: row.torch[0] for row in _ROWS if row.torch}


def byte_size(dtype: DType, numel: int) -> int | None:
    """Bytes taken by `numel` elements, or None when that is not a whole number of bytes
    (of blocks, for a block-quantized type)."""
    if dtype.quantized:
        return None if numel % dtype.block else numel // dtype.block * dtype.block_bytes
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
