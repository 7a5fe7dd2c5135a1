"""What each rewrite (reshard, convert, dedupe) and the writing of its plan take."""

from __future__ import annotations

from dataclasses import dataclass

from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.write.results import Progress


@dataclass(frozen=True)
class WriteOptions:
    max_shard: int
    to: str = "safetensors"
    in_place: bool = False
    dry_run: bool = False
    verify: bool = True
    progress: Progress | None = None
    config_dtype: str | None = None  # a cast's torch name, set in config.json (config_dtype.py)
    allow_expansion: bool = False  # write expanded tensors past plan.expansion's limits


@dataclass(frozen=True)
class RewriteOptions:
    """What every rewrite takes."""

    max_shard: int = DEFAULT_MAX_SHARD
    dry_run: bool = False
    force: bool = False  # replace an OUT that holds a checkpoint
    replace_any: bool = False  # with force: replace an OUT that holds other files too
    progress: Progress | None = None


@dataclass(frozen=True)
class ConvertOptions(RewriteOptions):
    to: str = "safetensors"  # or "torch"
    dtype: str = "keep"  # bf16, fp16, fp32 or keep
    key: str = "auto"  # where the tensors sit in a training checkpoint
    strip_prefix: str | None = None  # a prefix, "auto", or None
    exclude: tuple[str, ...] = ()  # globs of tensor names to leave out
    keep: str = "first"  # which alias name to keep: first, last or a regex
    clone: bool = False  # write every alias as its own copy
    verify: bool = True
    zero_weights: str = "master"  # DeepSpeed: fp32 master weights, or the `module` copy
    allow_expansion: bool = False  # see plan.expansion
    dequantize: str | None = None  # GGUF: decode block-quantized tensors to bf16, fp16, fp32
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
