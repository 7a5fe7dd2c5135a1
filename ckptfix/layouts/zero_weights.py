"""ZeRO's fp32 master weights as pieces of the optimizer partitions, exactly as DeepSpeed's
`zero_to_fp32.py` reconstructs them, without reading a byte.

Stages 1 and 2: each parameter group is the concatenation of the ranks' partitions; the
group's parameters follow one another in it (plus their alignment padding, when recorded),
and the total must agree with the partitions up to DeepSpeed's 2 × world-size alignment.
Stage 3: every parameter takes ceil(numel / world) elements at the same offset of every
rank's flat groups; the ranks' parts, concatenated and truncated to numel, are the weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptfix.core.sizes import padded
from ckptfix.core.tensor import Piece

Shape = tuple[int, ...]


class ReconstructionError(Exception):
    """The partitions do not hold what the shapes say (checked like zero_to_fp32.py)."""


@dataclass(frozen=True)
class Segment:
    """A run of `numel` elements of `itemsize` bytes at `offset` of the file `source`."""

    source: str
    offset: int
    numel: int
    itemsize: int


def numel(shape: Shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def slice_pieces(segments: Sequence[Segment], start: int, count: int, at: int) -> list[Piece]:
    """Elements [start, start + count) of the concatenated segments, placed at tensor byte
    `at`: one piece per segment they touch."""
    pieces, position = [], 0
    for segment in segments:
        low, high = max(start, position), min(start + count, position + segment.numel)
        if low < high:
            size = segment.itemsize
            offset = segment.offset + (low - position) * size
            pieces.append(Piece(segment.source, offset, (high - low) * size, at=at))
            at += (high - low) * size
        position += segment.numel
    if sum(piece.length for piece in pieces) != count * (segments[0].itemsize if segments else 0):
        raise ReconstructionError(f"elements {start}-{start + count} are past the partitions")
    return pieces


def stage12(
    groups: Sequence[Sequence[Segment]],
    shapes: Sequence[dict[str, Shape]],
    paddings: Sequence[Sequence[int]] | None,
    world: int,
) -> dict[str, list[Piece]]:
    """Stages 1-2: `groups[g][r]` is rank r's partition of group g."""
    if len(groups) != len(shapes):
        raise ReconstructionError(f"{len(groups)} partition groups for {len(shapes)} shape groups")
    weights: dict[str, list[Piece]] = {}
    for index, (segments, group) in enumerate(zip(groups, shapes, strict=True)):
        padding = paddings[index] if paddings is not None else [0] * len(group)
        if len(padding) != len(group):
            raise ReconstructionError(
                f"group {index} has {len(padding)} paddings for {len(group)} parameters"
            )
        offset = 0
        for (name, shape), pad in zip(group.items(), padding, strict=True):
            weights[name] = slice_pieces(segments, offset, numel(shape), 0)
            offset += numel(shape) + pad
        available = sum(segment.numel for segment in segments)
        if padded(offset, 2 * world) != padded(available, 2 * world):
            raise ReconstructionError(
                f"group {index}: the parameters take {offset} elements, the partitions hold {available}"
            )
    return weights


def stage3(ranks: Sequence[Sequence[Segment]], shapes: dict[str, Shape]) -> dict[str, list[Piece]]:
    """Stage 3: `ranks[r]` is rank r's flat groups, in order."""
    world = len(ranks)
    sizes = [[segment.numel for segment in groups] for groups in ranks]
    if any(size != sizes[0] for size in sizes):
        raise ReconstructionError("the ranks' flat groups differ in size")
    weights: dict[str, list[Piece]] = {}
    offset = 0
    for name, shape in shapes.items():
        total = numel(shape)
        part = -(-total // world)
        pieces = []
        for rank, groups in enumerate(ranks):
            take = max(0, min(part, total - rank * part))
            itemsize = groups[0].itemsize if groups else 0
            pieces += slice_pieces(groups, offset, take, rank * part * itemsize)
        weights[name] = pieces
        offset += part
    if offset != sum(sizes[0]):
        raise ReconstructionError(
            f"the parameters take {offset} elements per rank, the flat groups hold {sum(sizes[0])}"
        )
    return weights


def concatenated(segments: Sequence[Segment], shape: Shape) -> list[Piece]:
    """Stage-3 frozen parameters: the ranks' fragments concatenated, truncated to numel."""
    return slice_pieces(segments, 0, numel(shape), 0)
