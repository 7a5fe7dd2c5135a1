"""Tensors saved as chunks (row-major blocks at offsets): the pieces that place each chunk's
bytes in the whole tensor, and whether the chunks tile it exactly. Pure functions of shapes.

A chunk that spans every dimension but the first is one contiguous piece (a dim-0 shard).
Otherwise it is one piece of `count` runs, one per row of the chunk, each landing one row of
the tensor further on; only a chunk cut in two dimensions before its last cut needs one such
piece per index of the dimensions before those (e.g. one per expert of a 3-D weight cut
along its last two dimensions).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ckptfix.core.dtypes import numel_of
from ckptfix.core.tensor import Piece

MAX_PIECES_PER_CHUNK = 1 << 16
MAX_PIECES = 4_000_000  # per checkpoint: a 1,000-rank run of 1,000 tensors needs a quarter


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return strides[::-1]


@dataclass(frozen=True)
class Placed:
    """A chunk's bytes at `offset` of the file labelled `source`."""

    source: str
    offset: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def out_of_range(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    return any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True))


def pieces_needed(shape: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """How many pieces chunk_pieces makes for a chunk of `sizes` (see the module's doc)."""
    partial = [j for j, (s, d) in enumerate(zip(sizes, shape, strict=True)) if s != d]
    if len(partial) < 2:
        return 1
    return numel_of(sizes[: partial[-2]])


def chunk_pieces(placed: Placed, shape: tuple[int, ...], itemsize: int) -> list[Piece]:
    """The pieces placing one chunk (in range, non-empty) in the tensor's row-major bytes."""
    offsets, sizes = placed.offsets, placed.sizes
    stride = _strides(shape)
    partial = [j for j, (s, d) in enumerate(zip(sizes, shape, strict=True)) if s != d]
    nbytes = numel_of(sizes) * itemsize
    if not partial or partial[-1] == 0:  # the whole tensor, or a block of whole rows
        at = (offsets[0] * stride[0] if shape else 0) * itemsize
        return [Piece(placed.source, placed.offset, nbytes, at=at)]
    last = partial[-1]
    run = sizes[last] * stride[last] * itemsize
    first = partial[-2] if len(partial) > 1 else 0  # runs over dims first..last-1 are linear
    count = numel_of(sizes[first:last])
    base = offsets[first] * stride[first] + offsets[last] * stride[last]
    pieces = []
    source = placed.offset
    for outer in itertools.product(*(range(s) for s in sizes[:first])):
        at = base + sum((offsets[j] + i) * stride[j] for j, i in enumerate(outer))
        pieces.append(
            Piece(
                placed.source,
                source,
                run,
                at=at * itemsize,
                count=count,
                source_step=run,
                tensor_step=stride[last - 1] * itemsize,
            )
        )
        source += run * count
    return pieces


MAX_OVERLAP_VISITS = 20_000_000  # box visits of the overlap check: far above any real layout


class TooManyChunks(Exception):
    """The chunks of one tensor are too many, and too scattered, to check in bounded time."""


def first_overlap(chunks: list[Placed]) -> tuple[Placed, Placed] | None:
    """Two non-empty chunks that share an element, or None.

    Slabs: along dimension d, between consecutive chunk edges, the chunks present all overlap
    in d, so two of them overlap if and only if their extents in the later dimensions do;
    the last dimension is intervals sorted by start. A grid of chunks (what sharding makes)
    costs one visit per chunk per dimension; scattered layouts are bounded by
    MAX_OVERLAP_VISITS (TooManyChunks).
    """
    boxes = [chunk for chunk in chunks if numel_of(chunk.sizes)]
    if len(boxes) < 2:
        return None
    if not boxes[0].offsets:  # 0-d: any two non-empty chunks are the one element twice
        return boxes[0], boxes[1]
    return _overlap(boxes, 0, [MAX_OVERLAP_VISITS])


def _overlap(boxes: list[Placed], dim: int, budget: list[int]) -> tuple[Placed, Placed] | None:
    budget[0] -= len(boxes)
    if budget[0] < 0:
        raise TooManyChunks
    if dim == len(boxes[0].offsets) - 1:
        ordered = sorted(boxes, key=lambda box: box.offsets[dim])
        for first, second in itertools.pairwise(ordered):
            if second.offsets[dim] < first.offsets[dim] + first.sizes[dim]:
                return first, second
        return None
    edges = sorted({e for b in boxes for e in (b.offsets[dim], b.offsets[dim] + b.sizes[dim])})
    ordered = sorted(boxes, key=lambda box: box.offsets[dim])
    active: list[Placed] = []
    start = 0
    for low in edges[:-1]:
        while start < len(ordered) and ordered[start].offsets[dim] <= low:
            active.append(ordered[start])
            start += 1
        active = [box for box in active if box.offsets[dim] + box.sizes[dim] > low]
        if len(active) > 1 and (found := _overlap(active, dim + 1, budget)) is not None:
            return found
    return None
