"""GGUF split plans: which tensors go to which part of a llama.cpp split set, and where a
part's data starts. Pure integers, no I/O.

A part is one GGUF file: its header (the prefix, key/values — all of the source's metadata
in the first part, only the split keys in the others — and its tensor infos), padded to
the alignment, then each tensor padded to the alignment, in source order. Parts are packed
greedily so that each *file* stays within --max-shard (llama.cpp's `gguf-split
--split-max-size` counts tensor bytes only; a Hub upload limit is on files). A tensor whose
part would be over the limit on its own gets a part of its own in its place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckptfix.core.sizes import padded
from ckptfix.plan.align import Run, residue, shareable
from ckptfix.plan.shards import OutputName, PlannedShard, ShardPlan

PREFIX = 24  # magic, version, tensor count, key/value count
MAX_PARTS = 65_535  # split.count and split.no are UINT16 (llama.cpp reads them so)


@dataclass(frozen=True)
class PartEntry:
    """A tensor as the plan needs it: its bytes and the bytes of its tensor info."""

    name: str
    nbytes: int
    info: int


@dataclass(frozen=True)
class PartKeys:
    """Bytes of key/values in each part: the first part's (the carried metadata, plus the
    split keys when there are several parts), every other part's (the split keys, and the
    alignment where it is not the default), and the split keys' own."""

    first: int
    rest: int
    split: int


def part_size(keys: int, entries: Iterable[PartEntry], alignment: int) -> int:
    """A part's file size: header padded to the alignment, then every tensor padded."""
    entries = list(entries)
    header = PREFIX + keys + sum(entry.info for entry in entries)
    return padded(header, alignment) + sum(padded(entry.nbytes, alignment) for entry in entries)


def pack_parts(
    entries: Sequence[PartEntry], max_size: int, keys: PartKeys, alignment: int
) -> list[list[PartEntry]]:
    """Greedy packing in source order, by file size (see the module docstring). The part's
    tensor infos and padded data are kept as running sums: a model of a million tensors
    packs in one pass, not one pass per tensor."""
    groups: list[list[PartEntry]] = []
    current: list[PartEntry] = []
    infos = data = 0  # of `current`
    for entry in entries:
        own = keys.first if not groups else keys.rest
        size = padded(entry.nbytes, alignment)
        header = padded(PREFIX + own + infos + entry.info, alignment)
        if current and header + data + size > max_size:
            groups.append(current)
            current, infos, data = [], 0, 0
        current.append(entry)
        infos, data = infos + entry.info, data + size
    if current or not groups:
        groups.append(current)
    return groups


def plan_parts(
    entries: Sequence[PartEntry], max_size: int, stem: str, keys: PartKeys, alignment: int
) -> ShardPlan:
    """The parts of a GGUF rewrite: `stem.gguf` when it fits in one file (no split keys),
    else `stem-00001-of-0000N.gguf`, ... (llama.cpp's names)."""
    groups = pack_parts(entries, max_size, keys, alignment)
    if len(groups) == 1:  # one file: no split keys, so it is smaller than packed
        groups = [list(entries)]
    name = OutputName(stem, "gguf")
    count = len(groups)
    shards = tuple(
        PlannedShard(
            name.shard(number, count),
            tuple(entry.name for entry in group),
            sum(entry.nbytes for entry in group),
        )
        for number, group in enumerate(groups, start=1)
    )
    own = [keys.first - (keys.split if count == 1 else 0)] + [keys.rest] * (count - 1)
    oversized = tuple(
        group[0].name
        for group, size in zip(groups, own, strict=True)
        if len(group) == 1 and part_size(size, group, alignment) > max_size
    )
    return ShardPlan(max_shard=max_size, shards=shards, index_file=None, oversized=oversized)


@dataclass(frozen=True)
class StartRange:
    """Where a part's data may start: `start` (right after its header, aligned), or from
    `low` (room for the padding key) up to `start + room`, at multiples of `alignment`."""

    start: int
    low: int
    room: int
    alignment: int


def choose_start(where: StartRange, runs: Iterable[Run], block: int) -> int:
    """Where a part's data starts: `where.start` when that already lets the most bytes be
    cloned, or nothing can be; else the least padded start in range that lines up the most
    shareable bytes with their source's blocks. `runs` land at offsets relative to the data
    start (plan.align)."""
    weights: Counter[int] = Counter()
    for run in runs:
        if size := shareable(run, block):
            weights[residue(run, block)] += size
    start = where.start
    for wanted, _ in sorted(weights.items(), key=lambda item: (-item[1], item[0])):
        if start % block == wanted:
            return start
        chosen = where.low + (wanted - where.low) % block
        if chosen % where.alignment == 0 and chosen - start <= where.room:
            return chosen
    return start
