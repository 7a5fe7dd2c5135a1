"""Parts of a tensor's row-major bytes as new tensors made of the same pieces: one layer of a
tensor stacked by layer, one expert of a layer, rows of a matrix gathered from several
ranges (a query group's heads, the gate half of a fused projection). Pure functions of
pieces: no byte is read, a part of a piece is a piece (runs wholly inside a range are kept as
one piece, a run cut by the range's edge becomes a piece of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptfix.core.dtypes import DTYPES, numel_of
from ckptfix.core.tensor import Piece, TensorInfo


def _span(piece: Piece) -> tuple[int, int]:
    """The tensor bytes a piece's runs fall in, from the first run's start to the last's end."""
    return piece.at, piece.at + (piece.count - 1) * piece.tensor_step + piece.length


def _run(piece: Piece, index: int, low: int, high: int, at: int) -> Piece:
    """The part of run `index` that lands in tensor bytes [low, high), placed at `at`."""
    start = piece.at + index * piece.tensor_step
    return Piece(
        piece.source, piece.offset + index * piece.source_step + low - start, high - low, at
    )


def cut(pieces: Sequence[Piece], begin: int, end: int, at: int = 0) -> list[Piece]:
    """The pieces that provide tensor bytes [begin, end), placed from byte `at` on."""
    found: list[Piece] = []
    for piece in pieces:
        if piece.view is not None:
            raise ValueError("a strided view cannot be cut into parts")
        low, high = _span(piece)
        if high <= begin or low >= end or not piece.length:
            continue
        if piece.count == 1:
            lo, hi = max(low, begin), min(high, end)
            found.append(_run(piece, 0, lo, hi, at + lo - begin))
            continue
        found += _cut_runs(piece, begin, end, at)
    return found


def _cut_runs(piece: Piece, begin: int, end: int, at: int) -> list[Piece]:
    step, length = piece.tensor_step, piece.length
    first = max(0, (begin - piece.at - length) // step + 1)  # the first run ending after begin
    last = min(piece.count - 1, (end - 1 - piece.at) // step)  # the last starting before end
    whole_first = max(first, -(-(begin - piece.at) // step))  # runs wholly inside [begin, end)
    whole_last = min(last, (end - length - piece.at) // step)
    found = []
    if whole_first <= whole_last:
        start = piece.at + whole_first * step
        found.append(
            Piece(
                piece.source,
                piece.offset + whole_first * piece.source_step,
                length,
                at + start - begin,
                whole_last - whole_first + 1,
                piece.source_step,
                step,
            )
        )
    else:
        whole_first, whole_last = last + 1, last
    for index in [*range(first, whole_first), *range(max(whole_last + 1, first), last + 1)]:
        start = piece.at + index * step
        lo, hi = max(start, begin), min(start + length, end)
        if lo < hi:
            found.append(_run(piece, index, lo, hi, at + lo - begin))
    return found


def tensor_of(
    name: str, dtype: str, shape: tuple[int, ...], pieces: list[Piece], empty: str
) -> TensorInfo:
    """A TensorInfo made of `pieces` (one plain range when a single piece is the whole of
    it); `empty` labels the file of a tensor without bytes."""
    nbytes = numel_of(shape) * DTYPES[dtype].bits // 8
    first = pieces[0] if pieces else Piece(empty, 0, 0)
    single = len(pieces) == 1 and first.count == 1 and first.at == 0 and first.length == nbytes
    return TensorInfo(
        name=name,
        dtype=dtype,
        shape=shape,
        nbytes=nbytes,
        file=first.source,
        byte_range=(first.offset, first.offset + first.length),
        spread=None if single else tuple(pieces),
    )


def row_bytes(tensor: TensorInfo) -> int:
    """Bytes of one index of the first dimension (a row of a matrix, an element of a vector)."""
    rows = tensor.shape[0] if tensor.shape else 1
    return tensor.nbytes // rows if rows else 0


def gather_rows(
    tensor: TensorInfo, name: str, ranges: Sequence[tuple[int, int]], shape: tuple[int, ...]
) -> TensorInfo:
    """A tensor of `shape` made of the rows [start, stop) of each range, one after another."""
    size = row_bytes(tensor)
    pieces: list[Piece] = []
    at = 0
    for start, stop in ranges:
        pieces += cut(tensor.pieces, start * size, stop * size, at)
        at += (stop - start) * size
    return tensor_of(name, tensor.dtype, shape, pieces, tensor.file)


@dataclass
class Parts:
    """A tensor cut into equal consecutive parts of `part_bytes` (its layers, or its layers'
    experts): each piece is filed under the parts it reaches once, so cutting every part
    costs one pass over the pieces, not one per part."""

    tensor: TensorInfo
    part_bytes: int

    def __post_init__(self) -> None:
        self._by_part: dict[int, list[Piece]] = {}
        if not self.part_bytes:
            return
        for piece in self.tensor.pieces:
            low, high = _span(piece)
            for index in range(low // self.part_bytes, (high - 1) // self.part_bytes + 1):
                self._by_part.setdefault(index, []).append(piece)

    def part(self, index: int, name: str, shape: tuple[int, ...]) -> TensorInfo:
        begin = index * self.part_bytes
        pieces = cut(self._by_part.get(index, []), begin, begin + self.part_bytes)
        return tensor_of(name, self.tensor.dtype, shape, pieces, self.tensor.file)
