"""`--to-hf CONFIG`: a Megatron-Core checkpoint seen as the Hugging Face model CONFIG names,
for `convert` (what is written, and config.json beside it) and `diff` (what is compared).
The tensors are the checkpoint's own pieces under new names (mappings.apply): the writers
and hashes stream them as they stream any tensor."""

from __future__ import annotations

from dataclasses import replace

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import UsageError
from ckptfix.layouts.megatron import MegatronLayout
from ckptfix.mappings.apply import Mapped, map_tensors
from ckptfix.mappings.hf_config import Target, read_target
from ckptfix.ops.source import RewriteSource
from ckptfix.ops.tensorset import TensorSet
from ckptfix.plan.config_dtype import TARGET_NAMES, retype

CONFIG = "config.json"


def megatron_layout(checkpoint: Checkpoint) -> MegatronLayout:
    """The checkpoint's Megatron layout; anything else cannot be mapped with --to-hf."""
    if not isinstance(checkpoint.layout, MegatronLayout):
        raise UsageError(
            "--to-hf",
            f"{checkpoint.path} is not a Megatron-Core checkpoint ({checkpoint.kind}); "
            "--to-hf maps Megatron GPT checkpoints only",
            "drop --to-hf, or pass the Megatron checkpoint folder",
        )
    return checkpoint.layout


def _mapped(checkpoint: Checkpoint, spec: str, tensors: list[object]) -> tuple[Target, Mapped]:
    layout = megatron_layout(checkpoint)
    target = read_target(spec, layout.args, checkpoint.path)
    return target, map_tensors(target, tensors, checkpoint.path)  # type: ignore[arg-type]


def _config_text(target: Target, dtype: str | None) -> bytes:
    """config.json as written to OUT: the given one, or the one built from the training
    arguments; with --dtype, its dtype values set to the cast's (as convert --dtype does)."""
    if dtype is None:
        return target.text
    text, _ = retype(target.text.decode("utf-8"), TARGET_NAMES[dtype], CONFIG)
    return text.encode("utf-8")


def hf_source(source: RewriteSource, spec: str, dtype: str | None = None) -> RewriteSource:
    """What `convert --to-hf` writes: the mapped tensors, and config.json."""
    target, mapped = _mapped(source.checkpoint, spec, list(source.tensors))
    return replace(
        source,
        tensors=mapped.tensors,
        extra_files=(CONFIG,),
        generated={CONFIG: _config_text(target, dtype)},
    )


def hf_tensor_set(tensors: TensorSet, spec: str) -> TensorSet:
    """What `diff --to-hf` compares on the Megatron side: the mapped tensors."""
    assert tensors.checkpoint is not None
    _, mapped = _mapped(tensors.checkpoint, spec, list(tensors.tensors.values()))
    return replace(tensors, tensors={tensor.name: tensor for tensor in mapped.tensors})
