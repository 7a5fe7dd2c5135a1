"""What `ckptfix.save` writes for a mapping of tensors in memory: which names of shared
tensors are kept, and the shards. Pure data, no I/O.

Names and shards follow huggingface_hub's `save_torch_state_dict`, so that a program can
switch to ckptfix and get the same files: of names for exactly the same elements, the first
in sorted order is kept (huggingface_hub's `_remove_duplicate_names`), unless config.json ties
the head to the embedding, where the embedding is kept, as transformers saves it; tensors are
packed in the mapping's order, a tensor larger than the shard size gets a shard of its own
placed before the open one, and the tensors of one storage go to the shard of its first.
Where huggingface_hub would lose data or refuse (views of part of a storage, two shapes of
one storage), every tensor is written whole, and sizes are the bytes written.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckptfix.plan.shards import OutputName, PlannedShard, ShardPlan


@dataclass(frozen=True)
class Item:
    """A tensor to write: its name and bytes, the storage block it belongs to (tensors of
    one block share a shard), and its alias key (equal keys: the same elements), if any."""

    name: str
    nbytes: int
    block: object
    alias: object | None = None


@dataclass(frozen=True)
class Names:
    """The names decided: what is written (in order) and dropped -> kept for the others."""

    written: tuple[Item, ...]
    dropped: dict[str, str] = field(default_factory=dict)


def choose_names(
    items: Sequence[Item],
    *,
    dedupe: bool,
    tie: Mapping[str, str] | None = None,
    separate: frozenset[str] = frozenset(),
) -> Names:
    """Names of the same elements written once, the others recorded as aliases. `tie`
    ({head: embedding}) keeps the embedding where config.json ties the two; names in
    `separate` are always written (an untied head that shares the embedding's memory)."""
    if not dedupe:
        return Names(tuple(items))
    groups: dict[object, list[str]] = defaultdict(list)
    for item in items:
        if item.alias is not None:
            groups[item.alias].append(item.name)
    dropped: dict[str, str] = {}
    for names in groups.values():
        candidates = [name for name in names if name not in separate]
        if len(candidates) < 2:
            continue
        kept = min(candidates)
        for head, embedding in (tie or {}).items():
            if head in candidates and embedding in candidates:
                kept = embedding
        dropped.update({name: kept for name in candidates if name != kept})
    return Names(tuple(item for item in items if item.name not in dropped), dropped)


def split(items: Sequence[Item], max_shard: int) -> list[list[str]]:
    """huggingface_hub's split (`split_state_dict_into_shards_factory`) over storage blocks:
    a block is sized by the bytes of its tensors and placed where its first tensor is."""
    blocks: dict[object, list[Item]] = {}
    for item in items:
        blocks.setdefault(item.block, []).append(item)
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for members in blocks.values():
        names = [item.name for item in members]
        block_size = sum(item.nbytes for item in members)
        if block_size > max_shard:
            shards.append(names)  # before the open shard, as huggingface_hub places it
            continue
        if size + block_size > max_shard:
            shards.append(current)
            current, size = [], 0
        current += names
        size += block_size
    if current or not shards:
        shards.append(current)  # nothing to write still makes one (empty) file
    return shards


def plan_memory(items: Sequence[Item], max_shard: int, dropped: Mapping[str, str]) -> ShardPlan:
    """The shard plan: files named as transformers names them, the index when there are
    several, the aliases recorded."""
    sizes = {item.name: item.nbytes for item in items}
    groups = split(items, max_shard)
    name = OutputName()
    shards = tuple(
        PlannedShard(name.shard(number, len(groups)), tuple(group), sum(sizes[n] for n in group))
        for number, group in enumerate(groups, start=1)
    )
    return ShardPlan(
        max_shard=max_shard,
        shards=shards,
        index_file=name.index() if len(shards) > 1 else None,
        oversized=tuple(item.name for item in items if item.nbytes > max_shard),
        dropped=dict(dropped),
    )
