"""The options of the rewrites (reshard, convert, dedupe): frozen dataclasses with the CLI's
defaults, exported as `ckptfix.ReshardOptions`, `ConvertOptions` and `DedupeOptions`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ckptfix.core.choices import CastDtype, DecodeDtype, Target, ZeroWeights
from ckptfix.core.sizes import DEFAULT_MAX_SHARD, shard_size
from ckptfix.write.part_records import PartRecord
from ckptfix.write.results import Progress
from ckptfix.write.stores.base import StoredObject


@dataclass(frozen=True)
class PartTarget:
    """Inside a task of a split run: where slice `part` of `count` goes (the driver's
    staging folder, or the store URL) and the digest of the plan the driver made."""

    digest: str
    folder: str | None = None
    store: str | None = None
    existing: tuple[StoredObject, ...] = ()  # the store's objects as the driver found them
    part: int = 0
    count: int = 0


@dataclass(frozen=True)
class PartRequest:
    """What a task runs again to write its slice: the command (convert, reshard, dedupe) on
    SRC with the same options, `options.target` saying where (its part set per task)."""

    command: str
    src: str
    cwd: str
    out: str
    options: RewriteOptions
    tensors: int = 0  # how many the plan holds: each task loads their metadata again


class ShardRunner(Protocol):
    """Runs the slices of a plan elsewhere (executors.ray_work.RayShardRunner): the record
    of each slice, in order, or the first task's error."""

    def __call__(
        self, request: PartRequest, sizes: Sequence[int], progress: Progress | None
    ) -> list[PartRecord]: ...


@dataclass(frozen=True)
class WriteOptions:
    """What the writing of a rewrite's plan takes (internal; made from the options below)."""

    max_shard: int
    to: str = "safetensors"
    in_place: bool = False
    dry_run: bool = False
    verify: bool = True
    progress: Progress | None = None
    config_dtype: str | None = None  # a cast's torch name, set in config.json (config_dtype.py)
    allow_expansion: bool = False  # write expanded tensors past plan.expansion's limits
    split: PartRequest | None = None  # --part, --commit, --executor ray, or a task of these


@dataclass(frozen=True)
class RewriteOptions:
    """What every rewrite takes."""

    max_shard: int | str = DEFAULT_MAX_SHARD  # bytes, or "5GB" as --max-shard takes it
    dry_run: bool = False
    force: bool = False  # replace an OUT that holds a checkpoint
    replace_any: bool = False  # with force: replace an OUT that holds other files too
    progress: Progress | None = None
    # An object-store OUT (s3://, gs://, hf://): parts in flight, every object read back, and keeping the
    # objects already there that match the plan (write.store_sink)
    upload_concurrency: int = 8
    verify_readback: bool = False
    resume: bool = False
    hf_pr: bool = False  # an hf:// OUT: a pull request instead of a commit to the branch
    # Split runs (ops.rewrite_parts): write slice I of N (--part I/N); check every slice's
    # record and publish (--commit); run the slices elsewhere (--executor ray); or, inside
    # such a run's task, where its slice goes.
    part: tuple[int, int] | None = None
    commit: bool = False
    runner: ShardRunner | None = None
    target: PartTarget | None = None

    def __post_init__(self) -> None:
        shard_size(self.max_shard)  # a bad size is a ValueError when the options are made
        if self.upload_concurrency < 1:
            raise ValueError("upload_concurrency must be at least 1")
        if self.part is not None and not 1 <= self.part[0] <= self.part[1]:
            raise ValueError("part must be (I, N) with 1 <= I <= N")

    @property
    def is_split(self) -> bool:
        """Whether the shards are written in slices (see the fields above)."""
        return bool(self.part or self.commit or self.runner or self.target)

    @property
    def shard_bytes(self) -> int:
        """max_shard in bytes."""
        return shard_size(self.max_shard)


@dataclass(frozen=True)
class ConvertOptions(RewriteOptions):
    to: Target = "safetensors"  # or "torch"
    dtype: CastDtype = "keep"  # bf16, fp16, fp32 or keep
    key: str = "auto"  # where the tensors sit in a training checkpoint
    strip_prefix: str | None = None  # a prefix, "auto", or None
    exclude: tuple[str, ...] = ()  # globs of tensor names to leave out
    keep: str = "first"  # which alias name to keep: first, last or a regex
    clone: bool = False  # write every alias as its own copy
    verify: bool = True
    zero_weights: ZeroWeights = "master"  # DeepSpeed: master, module or universal weights
    allow_expansion: bool = False  # see plan.expansion
    dequantize: DecodeDtype | None = None  # GGUF: decode block-quantized tensors to this dtype
    to_hf: str | None = None  # Megatron: the Hugging Face config.json (or model type) to map to


@dataclass(frozen=True)
class DedupeOptions(RewriteOptions):
    by_content: bool = False
    clone: bool = False
    keep: str = "first"
    allow_expansion: bool = False  # see plan.expansion


@dataclass(frozen=True)
class ReshardOptions(RewriteOptions):
    in_place: bool = False
