"""Shard plans: which tensors go to which output file. Pure data, no I/O."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, chain, repeat
from operator import itemgetter

from ckptfix.plan.config_dtype import ConfigEdit


@dataclass(frozen=True)
class PlannedShard:
    """One output file and the tensors it holds, in order."""

    file: str
    tensors: tuple[str, ...]
    nbytes: int

    def to_dict(self) -> dict[str, object]:
        return {"file": self.file, "tensors": list(self.tensors), "bytes": self.nbytes}


@dataclass(frozen=True)
class ShardPlan:
    """Where every tensor goes, plus what the rewrite drops, renames, copies or leaves out."""

    max_shard: int
    shards: tuple[PlannedShard, ...]
    index_file: str | None
    oversized: tuple[str, ...] = ()
    dropped: dict[str, str] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)
    copied_files: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    dropped_bytes: int = 0  # what writing every dropped name as its own copy would add
    excluded: tuple[str, ...] = ()  # left out by --exclude
    metadata_scope: str = "every shard"  # or "first shard", when it is large (see below)
    kept_equal: tuple[tuple[str, ...], ...] = ()  # equal bytes, each name kept (by_content)
    left_out_reasons: dict[str, str] = field(default_factory=dict)  # left-out name -> why
    config_edits: tuple[ConfigEdit, ...] = ()  # dtype values a cast sets in config.json
    # torch output: alias -> kept name; the alias is a name of its own in the kept tensor's
    # shard (listed in its `tensors`), sharing its storage, where safetensors drops it
    shared: dict[str, str] = field(default_factory=dict)

    # Computed once per plan (the plan is frozen): writers ask for them per tensor and per
    # shard, which over tens of thousands of shards made a write quadratic.
    @cached_property
    def total_size(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    @cached_property
    def weight_map(self) -> dict[str, str]:
        return dict(chain.from_iterable(zip(s.tensors, repeat(s.file)) for s in self.shards))

    def to_dict(self) -> dict[str, object]:
        return {
            "max_shard": self.max_shard,
            "total_size": self.total_size,
            "shards": [shard.to_dict() for shard in self.shards],
            "index": self.index_file,
            "oversized": list(self.oversized),
            "dropped": dict(self.dropped),
            "dropped_bytes": self.dropped_bytes,
            "excluded": list(self.excluded),
            "renamed": dict(self.renamed),
            "copied_files": list(self.copied_files),
            "left_out": list(self.left_out),
            "metadata_scope": self.metadata_scope,
            "kept_equal": [list(group) for group in self.kept_equal],
            "left_out_reasons": dict(self.left_out_reasons),
            "config_edits": [edit.to_dict() for edit in self.config_edits],
            "shared": dict(self.shared),
        }


# String metadata up to this size goes into every shard, as huggingface_hub writes it; a
# larger amount (10 MB of it would cost 200 MB over 20 shards) only into the first shard,
# with "format" still in every shard.
SHARED_METADATA_LIMIT = 64 * 2**10


def metadata_per_shard(
    metadata: Mapping[str, str], count: int
) -> tuple[list[Mapping[str, str]], str]:
    """Each shard's header metadata, and where the full metadata went."""
    size = sum(len(key) + len(value) for key, value in metadata.items())
    if count == 1 or size <= SHARED_METADATA_LIMIT:
        return [metadata] * count, "every shard"
    rest = {key: value for key, value in metadata.items() if key == "format"}
    return [metadata] + [rest] * (count - 1), "first shard"


@dataclass(frozen=True)
class OutputName:
    """How output files are named: the family's stem, its variant, the extension. Hugging
    Face naming: one shard is `model.safetensors`, else `model-00001-of-00003.safetensors`
    with `model.safetensors.index.json`; a variant goes after the stem
    (`model.fp16-00001-of-00002.safetensors`) and at the end of the index name
    (`model.safetensors.index.fp16.json`), as transformers and diffusers write them."""

    stem: str = "model"
    ext: str = "safetensors"
    variant: str | None = None

    def shard(self, number: int, count: int) -> str:
        base = f"{self.stem}.{self.variant}" if self.variant else self.stem
        if count == 1:
            return f"{base}.{self.ext}"
        return f"{base}-{number:05d}-of-{count:05d}.{self.ext}"

    def index(self) -> str:
        variant = f".{self.variant}" if self.variant else ""
        return f"{self.stem}.{self.ext}.index{variant}.json"


# The stem of the same family in the other format: transformers names its .bin files
# `pytorch_model*`, its safetensors `model*`; the other families keep their stem.
_TORCH_STEMS = {"model": "pytorch_model"}
_SAFETENSORS_STEMS = {"pytorch_model": "model"}


def output_name(stem: str, variant: str | None, ext: str) -> OutputName:
    """The names a family's rewrite gets in `ext` ("safetensors" or "bin")."""
    table = _TORCH_STEMS if ext == "bin" else _SAFETENSORS_STEMS
    return OutputName(table.get(stem, stem), ext, variant)


def pack(sizes: Sequence[tuple[str, int]], max_shard: int) -> list[list[tuple[str, int]]]:
    """Greedy packing in source order.

    A tensor larger than `max_shard` closes the open shard and gets one of its own in its
    place, so order is kept (huggingface_hub moves such tensors ahead instead). No shard is
    ever empty; zero-byte tensors join the open shard.
    """
    if sizes and max(map(itemgetter(1), sizes)) <= max_shard:
        return _pack_fitting(sizes, max_shard)
    return _pack_one_by_one(sizes, max_shard)


def _pack_one_by_one(
    sizes: Sequence[tuple[str, int]], max_shard: int
) -> list[list[tuple[str, int]]]:
    """`pack`, adding one tensor at a time."""
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard:
            if current:
                groups.append(current)
            groups.append([(name, size)])
            current, current_size = [], 0
            continue
        if current and current_size + size > max_shard:
            groups.append(current)
            current, current_size = [], 0
        current.append((name, size))
        current_size += size
    if current or not groups:
        groups.append(current)  # a checkpoint with no tensors still gets its one file
    return groups


def _pack_fitting(sizes: Sequence[tuple[str, int]], max_shard: int) -> list[list[tuple[str, int]]]:
    """`pack` of tensors none of which is over the limit, a shard at a time: each shard
    takes the longest run from where the last ended that fits (found by bisection in the
    running totals), which is what adding them one by one while they fit gives."""
    totals = list(accumulate(map(itemgetter(1), sizes), initial=0))
    groups, start = [], 0
    while start < len(sizes):
        stop = bisect_right(totals, totals[start] + max_shard) - 1  # past `start`: it fits
        groups.append(list(sizes[start:stop]))
        start = stop
    return groups


def plan_shards(
    sizes: Sequence[tuple[str, int]], max_shard: int, name: OutputName | None = None
) -> ShardPlan:
    """Plan output shards for tensors given as (name, bytes) in source order."""
    name = name or OutputName()
    groups = pack(sizes, max_shard)
    count = len(groups)
    shards = tuple(
        PlannedShard(
            file=name.shard(number, count),
            tensors=tuple(map(itemgetter(0), group)),
            nbytes=sum(map(itemgetter(1), group)),
        )
        for number, group in enumerate(groups, start=1)
    )
    oversized: tuple[str, ...] = ()
    if max(map(itemgetter(1), sizes), default=0) > max_shard:  # rare: look again only then
        oversized = tuple(name for name, size in sizes if size > max_shard)
    return ShardPlan(
        max_shard=max_shard,
        shards=shards,
        index_file=name.index() if count > 1 else None,
        oversized=oversized,
    )


def with_shared(
    shards: Sequence[PlannedShard], names: Sequence[str], shared: Mapping[str, str]
) -> tuple[PlannedShard, ...]:
    """Each shard with the aliases (`shared`: alias -> kept) of its tensors added as names
    of their own, every shard listing its names in `names` order (the source order)."""
    home = {name: number for number, shard in enumerate(shards) for name in shard.tensors}
    listed: list[dict[str, None]] = [{} for _ in shards]
    for name in (*names, *shared, *home):  # any name `names` missed goes last
        kept = shared.get(name, name)
        if kept in home:
            listed[home[kept]][name] = None
    return tuple(
        PlannedShard(shard.file, tuple(names_of), shard.nbytes)
        for shard, names_of in zip(shards, listed, strict=True)
    )
