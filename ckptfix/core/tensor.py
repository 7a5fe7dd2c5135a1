"""Tensor descriptors: what a checkpoint holds, without its data.

A tensor's row-major bytes are made of pieces: byte ranges of source files, each landing
at a known place in the tensor. Most tensors are one piece (a range of one file); a tensor
saved by several ranks is several; a strided view of a pickled storage is one piece that is
gathered rather than copied.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import attrgetter, eq, floordiv, mul

from ckptfix.core.dtypes import DTYPES


@dataclass(frozen=True, slots=True)
class Piece:
    """`count` runs of `length` bytes from the source labelled `source`: run i is read at
    `offset + i * source_step` and lands at byte `at + i * tensor_step` of the tensor.

    With `view` (shape, element strides), the piece is instead the storage span
    [offset, offset + length) of one strided view, gathered into row-major order.
    """

    source: str
    offset: int
    length: int
    at: int = 0
    count: int = 1
    source_step: int = 0
    tensor_step: int = 0
    view: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """(source offset, tensor offset, length) of each run, in order."""
        for index in range(self.count):
            yield (
                self.offset + index * self.source_step,
                self.at + index * self.tensor_step,
                self.length,
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor this piece provides (a view's: see TensorInfo.nbytes)."""
        return self.length * self.count


# Not frozen: a frozen dataclass costs ~4 µs per instance to build, which is most of the
# time spent on a 100,000-tensor folder. Treat instances as immutable all the same.
@dataclass(slots=True)
class TensorInfo:
    """One named tensor: dtype, shape, and where its bytes lie.

    `file` and `byte_range` are where the tensor lies in its file (for a strided view: the
    storage span it reads); `spread` lists the pieces of a tensor made of several.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    byte_range: tuple[int, int]
    contiguous: bool = True
    storage: str | None = None
    # Pickled tensors only: element strides. For a non-contiguous view, byte_range is the
    # span of storage it reads, not its bytes.
    strides: tuple[int, ...] | None = None
    spread: tuple[Piece, ...] | None = None

    @property
    def numel(self) -> int:
        # Exact: nbytes was validated as numel * bits / 8, or as whole blocks of a
        # block-quantized dtype. O(1), unlike a product of dims; inline, since it is summed
        # over every tensor of a report.
        dtype = DTYPES[self.dtype]
        if dtype.block_bytes:
            return self.nbytes // dtype.block_bytes * dtype.block
        return self.nbytes * 8 // dtype.bits

    @property
    def pieces(self) -> tuple[Piece, ...]:
        if self.spread is not None:
            return self.spread
        begin, end = self.byte_range
        if self.contiguous or self.strides is None:
            return (Piece(self.file, begin, self.nbytes),)
        return (Piece(self.file, begin, end - begin, view=(self.shape, self.strides)),)

    @property
    def sources(self) -> tuple[str, ...]:
        """The labels of the files this tensor's bytes come from."""
        return tuple(dict.fromkeys(piece.source for piece in self.pieces))


def tiling_problem(tensor: TensorInfo) -> str | None:
    """Why the pieces of a tensor do not cover its bytes exactly once (None when they do):
    a gap, an overlap, or a run past the end."""
    runs = sorted(
        (at, at + length)
        for piece in tensor.pieces
        if piece.view is None
        for _, at, length in piece.runs()
    )
    if any(piece.view is not None for piece in tensor.pieces):
        return None if len(tensor.pieces) == 1 else "a strided view cannot be one of several pieces"
    expected = 0
    for begin, end in runs:
        if begin > expected:
            return f"bytes {expected}-{begin} of {tensor.name!r} come from no piece"
        if begin < expected:
            return f"bytes {begin}-{min(end, expected)} of {tensor.name!r} come from two pieces"
        expected = end
    if expected != tensor.nbytes:
        side = "past its end" if expected > tensor.nbytes else f"only up to byte {expected}"
        return f"the pieces of {tensor.name!r} ({tensor.nbytes} bytes) reach {side}"
    return None


_DTYPE, _NBYTES = attrgetter("dtype"), attrgetter("nbytes")


def bytes_by_dtype(tensors: Sequence[TensorInfo]) -> dict[str, int]:
    """Total bytes of each dtype, in order of first appearance (a pass in C per dtype)."""
    dtypes = list(map(_DTYPE, tensors))
    kinds = list(dict.fromkeys(dtypes))
    if len(kinds) == 1:  # the usual model
        return {kinds[0]: sum(map(_NBYTES, tensors))}
    sizes = list(map(_NBYTES, tensors))
    return {kind: sum(compress(sizes, map(eq, dtypes, repeat(kind)))) for kind in kinds}


def parameter_count(tensors: Sequence[TensorInfo]) -> int:
    """The sum of every tensor's `numel`, each as that property computes it, in C."""
    dtypes = list(map(_DTYPE, tensors))
    kinds = {kind: DTYPES[kind] for kind in set(dtypes)}
    if any(dtype.block_bytes for dtype in kinds.values()):  # block-quantized: rare
        return sum(tensor.numel for tensor in tensors)
    bits = {kind: dtype.bits for kind, dtype in kinds.items()}
    eighths = map(mul, map(_NBYTES, tensors), repeat(8))
    return sum(map(floordiv, eighths, map(bits.__getitem__, dtypes)))


def concatenated(groups: Iterable[tuple[TensorInfo, ...]]) -> tuple[TensorInfo, ...]:
    """The tensors of several files as one tuple; one file's own tuple, not a copy."""
    groups = list(groups)
    return groups[0] if len(groups) == 1 else tuple(chain.from_iterable(groups))
