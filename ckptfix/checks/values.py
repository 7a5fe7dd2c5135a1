"""Reading tensor bytes, only when asked: content hashes and NaN/Inf scans.

Non-finite values are found with bit masks on the raw integers, which works the same for
every float format (bf16 and fp8 included) without torch and without float conversion.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptfix.core.findings import Finding, finding, name_list
from ckptfix.core.sizes import format_size
from ckptfix.core.tensor import TensorInfo
from ckptfix.io import gather
from ckptfix.io.gather import Sources
from ckptfix.io.source import ByteSource

if TYPE_CHECKING:
    import numpy as np

CHUNK = 8 * 2**20


def tensor_chunks(source: Sources | ByteSource, tensor: TensorInfo) -> Iterator[bytes]:
    """A tensor's row-major bytes in bounded chunks (a strided view gathered block by block,
    since its byte range is the storage span it reads, not its content)."""
    return gather.tensor_chunks(source, tensor, CHUNK)


def digest(source: Sources | ByteSource, tensor: TensorInfo) -> bytes:
    import hashlib  # 3 ms to import (OpenSSL), and a plain inspect never hashes

    hasher = hashlib.blake2b(digest_size=32)
    for chunk in tensor_chunks(source, tensor):
        hasher.update(chunk)
    return hasher.digest()


def content_groups(
    tensors: Sequence[TensorInfo], source: Callable[[str], ByteSource]
) -> list[list[TensorInfo]]:
    """Groups of tensors with identical dtype, shape and bytes. Only tensors whose dtype and
    shape collide with another's are hashed at all."""
    candidates: dict[tuple[str, tuple[int, ...]], list[TensorInfo]] = defaultdict(list)
    for tensor in tensors:
        if tensor.nbytes:
            candidates[(tensor.dtype, tensor.shape)].append(tensor)
    groups: list[list[TensorInfo]] = []
    for members in candidates.values():
        if len(members) < 2:
            continue
        by_digest: dict[bytes, list[TensorInfo]] = defaultdict(list)
        for tensor in members:
            by_digest[digest(source, tensor)].append(tensor)
        groups.extend(group for group in by_digest.values() if len(group) > 1)
    return groups


def duplicate_content_findings(groups: Sequence[Sequence[TensorInfo]]) -> list[Finding]:
    found = []
    for group in groups:
        names = [tensor.name for tensor in group]
        wasted = group[0].nbytes * (len(group) - 1)
        found.append(
            finding(
                "duplicate-content",
                f"{len(group)} tensors hold identical bytes ({name_list(names, 3)}); "
                f"{format_size(wasted)} stored more than once (`ckptfix dedupe --by-content` "
                "stores them once)",
                file=group[0].file,
                tensors=names,
            )
        )
    return found


@dataclass(frozen=True)
class _FloatBits:
    """How NaN and Inf are encoded: `nan` values match nan_mask exactly where given, else
    IEEE style (exponent all ones; zero mantissa = Inf, non-zero = NaN)."""

    width: int
    exponent: int = 0
    mantissa: int = 0
    nan_exact: tuple[int, ...] = ()
    nan_mask: int = 0


_BITS: dict[str, _FloatBits] = {
    "F16": _FloatBits(16, 0x7C00, 0x03FF),
    "BF16": _FloatBits(16, 0x7F80, 0x007F),
    "F32": _FloatBits(32, 0x7F800000, 0x007FFFFF),
    "C64": _FloatBits(32, 0x7F800000, 0x007FFFFF),
    "F64": _FloatBits(64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F8_E5M2": _FloatBits(8, 0x7C, 0x03),
    # E4M3 "fn": no infinities; S.1111.111 is NaN.
    "F8_E4M3": _FloatBits(8, nan_mask=0x7F),
    # The "fnuz" formats spend negative zero (0x80) on their only NaN.
    "F8_E4M3FNUZ": _FloatBits(8, nan_exact=(0x80,)),
    "F8_E5M2FNUZ": _FloatBits(8, nan_exact=(0x80,)),
    "F8_E8M0": _FloatBits(8, nan_exact=(0xFF,)),
}


def _count_non_finite(values: np.ndarray, bits: _FloatBits) -> tuple[int, int]:
    import numpy as np

    if bits.nan_exact:
        return int(np.isin(values, bits.nan_exact).sum()), 0
    if bits.nan_mask:
        return int(np.count_nonzero((values & bits.nan_mask) == bits.nan_mask)), 0
    special = (values & bits.exponent) == bits.exponent
    if not special.any():
        return 0, 0
    has_mantissa = (values & bits.mantissa) != 0
    nan = int(np.count_nonzero(special & has_mantissa))
    return nan, int(np.count_nonzero(special)) - nan


def count_non_finite(source: Sources | ByteSource, tensor: TensorInfo) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor; (0, 0) for formats without them."""
    bits = _BITS.get(tensor.dtype)
    if bits is None:
        return 0, 0
    import numpy as np

    unsigned = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[bits.width]
    nan = inf = 0
    # CHUNK is a multiple of every element width, so chunks never split an element.
    for chunk in tensor_chunks(source, tensor):
        values = np.frombuffer(chunk, dtype=np.dtype(unsigned).newbyteorder("<"))
        chunk_nan, chunk_inf = _count_non_finite(values, bits)
        nan += chunk_nan
        inf += chunk_inf
    return nan, inf


def non_finite_findings(
    tensors: Sequence[TensorInfo], source: Callable[[str], ByteSource]
) -> list[Finding]:
    found = []
    for tensor in tensors:
        nan, inf = count_non_finite(source, tensor)
        if nan or inf:
            found.append(
                finding(
                    "non-finite",
                    f"tensor {tensor.name!r} ({tensor.dtype}) holds {nan} NaN and {inf} Inf value(s) "
                    f"out of {tensor.numel}; the export or training diverged (re-export from a good "
                    "step)",
                    file=tensor.file,
                    tensors=[tensor.name],
                )
            )
    return found
