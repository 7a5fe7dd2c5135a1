"""Where a shard's tensor data starts, so that its bytes can share the source's blocks.

A filesystem with reflinks (XFS, btrfs, bcachefs, ZFS ≥ 2.2, ...) clones a range, sharing
its blocks instead of copying them, only between block-aligned offsets. safetensors allows
spaces after the JSON header, so the data start of each shard can move by less than one
block to make it congruent, modulo the block size, with where the shard's bytes sit in their
source: then every whole block of those bytes can be shared. Pure integers, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

# The unpadded data start is a multiple of this (the reference writer's layout), so a
# tensor at a multiple of its element size in the data is aligned for it in memory too.
DATA_ALIGNMENT = 8


@dataclass(frozen=True)
class Run:
    """`length` bytes of the file labelled `source`, read at `offset`, landing at byte `at`
    of the shard's data (the bytes after the header)."""

    source: str
    offset: int
    at: int
    length: int


def aligned_split(src_offset: int, dst_offset: int, length: int, block: int) -> tuple[int, int]:
    """(head, body) of a range copied from `src_offset` to `dst_offset`: the first `head`
    bytes are copied, the next `body` bytes are whole blocks at block-aligned offsets on both
    sides, which can be cloned; the rest (the tail, under one block) is copied. A range whose
    offsets are not congruent modulo `block` has no body."""
    if block <= 0 or (src_offset - dst_offset) % block:
        return length, 0
    head = min(-src_offset % block, length)
    body = (length - head) // block * block
    return head, body


def shareable(run: Run, block: int) -> int:
    """The bytes of `run` in whole source blocks: what cloning it could share, once the
    shard's data start makes its offsets congruent."""
    first = -(-run.offset // block) * block
    last = (run.offset + run.length) // block * block
    return max(last - first, 0)


def residue(run: Run, block: int) -> int:
    """The data start, modulo `block`, at which `run` lands block-aligned."""
    return (run.offset - run.at) % block


class Alignment:
    """Which data starts keep the tensors of a shard aligned for their element size.

    A tensor is given as (offset in the data, element size in bytes, residue): the residue is
    the data start (modulo the block) at which it lands at its source offset modulo the block,
    None when it does not come whole from one source run. A start may leave a tensor
    misaligned only where the unpadded layout does too, or where the tensor keeps its
    source's own alignment (it lands at its source offset modulo the block, so modulo 8 too).
    """

    def __init__(self, tensors: Iterable[tuple[int, int, int | None]] = ()) -> None:
        self.totals: Counter[int] = Counter()
        self.by_residue: dict[int, Counter[int]] = {}
        for at, width, residue in tensors:
            width = min(width, DATA_ALIGNMENT)
            if width > 1 and at % width == 0:  # aligned in the unpadded layout
                self.totals[width] += 1
                if residue is not None:
                    self.by_residue.setdefault(residue, Counter())[width] += 1

    def modulus(self, residue: int) -> int:
        """What the data start must be a multiple of, if it is `residue` modulo the block."""
        exempt = self.by_residue.get(residue, Counter())
        return max((w for w, count in self.totals.items() if count > exempt[w]), default=1)


def choose_data_start(
    base: int, runs: Iterable[Run], block: int, room: int, alignment: Alignment | None = None
) -> int:
    """Where a shard's data should start: `base` (8 + the unpadded header, a multiple of
    DATA_ALIGNMENT) moved up by the least padding that aligns the most shareable bytes, with
    at most `room` bytes of padding; `base` itself when no run has a whole block to share.

    Runs are grouped by the data start they need (modulo `block`): one pad aligns every run
    of a shard that comes, in order and contiguously, from one source region, and any other
    run that happens to need the same start. A start that would misalign a tensor (see
    Alignment; without one, any start not a multiple of DATA_ALIGNMENT) is not used.
    """
    weights: dict[int, int] = {}
    for run in runs:
        if size := shareable(run, block):
            wanted = residue(run, block)
            weights[wanted] = weights.get(wanted, 0) + size
    modulus = alignment.modulus if alignment is not None else lambda _: DATA_ALIGNMENT
    weights = {wanted: size for wanted, size in weights.items() if wanted % modulus(wanted) == 0}
    candidates = sorted(weights.items(), key=lambda item: (-item[1], (item[0] - base) % block))
    for wanted, _ in candidates:
        pad = (wanted - base) % block
        if pad <= room:
            return base + pad
    return base
