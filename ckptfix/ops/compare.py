"""Comparing two tensors chunk by chunk, in bounded memory: equal bytes (and the content
digest, hashed from one side only while the two agree), or, with values, how they differ.

Element values are decoded with numpy from their bit patterns, without torch: F64, F32,
F16, BF16 (shifted into float32), the 8-bit float formats (a 256-entry table each) and C64.
Integer and bool tensors get a count of differing elements; sub-byte formats (F4, F6) only
"bytes differ".
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.gather import Sources, tensor_chunks
from ckptfix.ops.digest import chunk_size, content_header

if TYPE_CHECKING:
    import numpy as np

Buffer = bytes | memoryview


@dataclass(frozen=True)
class ValueDiff:
    """How two tensors of one dtype and shape differ, element by element.

    `differing` counts elements whose bit patterns differ; `max_abs` is the largest |a - b|
    and `max_rel` the largest |a - b| / max(|a|, |b|) over them (None where the dtype has no
    numeric comparison); `non_finite` counts differing elements with a NaN or an infinity on
    one side only (left out of both maxima). Two NaNs count as differing only in bits.
    """

    numel: int
    differing: int
    max_abs: float | None = None
    max_rel: float | None = None
    non_finite: int = 0

    def to_dict(self) -> dict[str, object]:
        return {
            "numel": self.numel,
            "differing": self.differing,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "non_finite": self.non_finite,
        }


@dataclass(frozen=True)
class PairResult:
    """The outcome for one pair: equal (with the content digest) or not (with values)."""

    equal: bool
    content: bytes = b""
    values: ValueDiff | None = None


def aligned(left: Iterator[bytes], right: Iterator[bytes]) -> Iterator[tuple[Buffer, Buffer]]:
    """Pairs of equally long pieces of two byte streams of one length (their chunks may be
    cut differently: a strided view is gathered in blocks of whole rows). Whole chunks are
    passed on as they are."""
    a: bytes = b""
    b: bytes = b""
    at_a = at_b = 0
    while True:
        if at_a == len(a):
            a, at_a = next(left, b""), 0
        if at_b == len(b):
            b, at_b = next(right, b""), 0
        if not a or not b:
            return
        size = min(len(a) - at_a, len(b) - at_b)
        yield _piece(a, at_a, size), _piece(b, at_b, size)
        at_a += size
        at_b += size


def _piece(data: bytes, at: int, size: int) -> Buffer:
    return data if at == 0 and size == len(data) else memoryview(data)[at : at + size]


def _same(left: Buffer, right: Buffer) -> bool:
    if isinstance(left, bytes) and isinstance(right, bytes):
        return left == right  # memcmp
    import numpy as np

    return bool(np.array_equal(np.frombuffer(left, np.uint8), np.frombuffer(right, np.uint8)))


def compare_pair(
    a: tuple[Sources, TensorInfo],
    b: tuple[Sources, TensorInfo],
    *,
    values: bool,
    stop: threading.Event,
    advance: Callable[[int], None],
) -> PairResult:
    """Compare two tensors of one dtype and shape. Without `values`, reading stops at the
    first difference."""
    (sources_a, tensor_a), (sources_b, tensor_b) = a, b
    hasher = hashlib.sha256(content_header(tensor_a.dtype, tensor_a.shape))
    measured = values and Stats.supports(tensor_a.dtype)
    stats = Stats(tensor_a.dtype, tensor_a.numel) if measured else None
    equal = True
    chunk = max(chunk_size(sources_a, tensor_a), chunk_size(sources_b, tensor_b))
    left_chunks = tensor_chunks(sources_a, tensor_a, chunk)
    right_chunks = tensor_chunks(sources_b, tensor_b, chunk)
    for left, right in aligned(left_chunks, right_chunks):
        if stop.is_set():
            break
        advance(2 * len(left))
        if equal and _same(left, right):
            hasher.update(left)
            continue
        equal = False
        if stats is None:
            break
        stats.add(left, right)
    if equal:
        return PairResult(True, hasher.digest())
    return PairResult(False, values=stats.result() if stats is not None else None)


class Stats:
    """Differences accumulated over the chunks where two tensors differ."""

    def __init__(self, dtype: str, numel: int) -> None:
        unsigned = DTYPES[dtype].unsigned
        assert unsigned is not None, "whole-byte dtypes only (see supports)"
        self.unsigned = unsigned
        self.decode = DECODERS.get(dtype)
        self.numel = numel
        self.differing = 0
        self.non_finite = 0
        self.max_abs = 0.0
        self.max_rel = 0.0

    @staticmethod
    def supports(dtype: str) -> bool:
        """Whether elements can be told apart: whole bytes each (not F4, F6)."""
        return DTYPES[dtype].bits % 8 == 0 and DTYPES[dtype].unsigned is not None

    def add(self, left: Buffer, right: Buffer) -> None:
        import numpy as np

        bits_a = np.frombuffer(left, np.dtype(self.unsigned))
        bits_b = np.frombuffer(right, np.dtype(self.unsigned))
        differ = bits_a != bits_b
        count = int(np.count_nonzero(differ))
        self.differing += count
        if count and self.decode is not None:
            with np.errstate(invalid="ignore"):  # casting a signalling NaN raises "invalid"
                x, y = self.decode(bits_a[differ]), self.decode(bits_b[differ])
            self._numbers(x, y)

    def _numbers(self, x: np.ndarray, y: np.ndarray) -> None:
        import numpy as np

        with np.errstate(invalid="ignore", over="ignore"):
            gap = np.abs(x - y)
            gap[np.isnan(x) & np.isnan(y)] = 0.0
            finite = np.isfinite(gap)
            self.non_finite += int(gap.size - np.count_nonzero(finite))
            gap = gap[finite]
            if not gap.size:
                return
            scale = np.maximum(np.abs(x), np.abs(y))[finite]
            relative = np.divide(gap, scale, out=np.zeros_like(gap), where=scale > 0)
        self.max_abs = max(self.max_abs, float(gap.max()))
        self.max_rel = max(self.max_rel, float(relative.max()))

    def result(self) -> ValueDiff:
        if self.decode is None:  # integers and bool: a count only
            return ValueDiff(self.numel, self.differing)
        return ValueDiff(self.numel, self.differing, self.max_abs, self.max_rel, self.non_finite)


def _float8_table(exponent: int, mantissa: int, bias: int, kind: str) -> Any:
    """The value of each of the 256 bit patterns of an 8-bit float format."""
    import numpy as np

    values = np.empty(256, dtype=np.float64)
    for bits in range(256):
        sign = -1.0 if bits >> 7 else 1.0
        biased = (bits >> mantissa) & ((1 << exponent) - 1)
        fraction = bits & ((1 << mantissa) - 1)
        if biased == 0:
            magnitude = fraction * 2.0 ** (1 - bias - mantissa)
        else:
            magnitude = (1 + fraction / 2**mantissa) * 2.0 ** (biased - bias)
        values[bits] = sign * magnitude
    top = (1 << exponent) - 1
    if kind == "ieee":  # E5M2: exponent all ones is Inf (no mantissa) or NaN
        for bits in range(256):
            if (bits >> mantissa) & top == top:
                fraction = bits & ((1 << mantissa) - 1)
                values[bits] = np.nan if fraction else (-np.inf if bits >> 7 else np.inf)
    elif kind == "fn":  # E4M3FN: no Inf; S.1111.111 is NaN
        values[0x7F] = values[0xFF] = np.nan
    else:  # "fnuz": no Inf, no negative zero; 0x80 is the only NaN
        values[0x80] = np.nan
    return values


def _e8m0_table() -> Any:
    import numpy as np

    values = 2.0 ** (np.arange(256, dtype=np.float64) - 127)
    values[255] = np.nan
    return values


_TABLES: dict[str, Callable[[], Any]] = {
    "F8_E5M2": lambda: _float8_table(5, 2, 15, "ieee"),
    "F8_E4M3": lambda: _float8_table(4, 3, 7, "fn"),
    "F8_E4M3FNUZ": lambda: _float8_table(4, 3, 8, "fnuz"),
    "F8_E5M2FNUZ": lambda: _float8_table(5, 2, 16, "fnuz"),
    "F8_E8M0": _e8m0_table,
}
_CACHE: dict[str, Any] = {}


def _table_decoder(dtype: str) -> Callable[[Any], Any]:
    def decode(bits: Any) -> Any:
        if dtype not in _CACHE:
            _CACHE[dtype] = _TABLES[dtype]()
        return _CACHE[dtype][bits]

    return decode


def _view(numpy_type: str) -> Callable[[Any], Any]:
    def decode(bits: Any) -> Any:
        import numpy as np

        values = bits.view(numpy_type)
        return values.astype(np.complex128 if values.dtype.kind == "c" else np.float64)

    return decode


def _bfloat16(bits: Any) -> Any:
    import numpy as np

    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


DECODERS: dict[str, Callable[[Any], Any]] = {
    "F64": _view("<f8"),
    "F32": _view("<f4"),
    "F16": _view("<f2"),
    "C64": _view("<c8"),
    "BF16": _bfloat16,
    **{dtype: _table_decoder(dtype) for dtype in _TABLES},
}
