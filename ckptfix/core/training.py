"""What a training checkpoint folder (torch.distributed.checkpoint, DeepSpeed ZeRO) is, beyond
its tensors: the facts inspect shows, what was left out, and the problems found reading it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptfix.core.findings import Finding

RANK_SUFFIX = ".distcp"  # a DCP rank's data file: __0_0.distcp


@dataclass(frozen=True)
class TrainingLayout:
    """The layout of a training checkpoint: set on `Checkpoint.training` by its loader."""

    framework: str  # "dcp", "deepspeed", "megatron" or "hf-storage" (torch's per-rank HF writer)
    world_size: int | None = None
    serialization: str | None = None  # DCP: "torch_save" or "safetensors"
    tag: str | None = None  # DeepSpeed: the tag folder, e.g. "global_step1000"
    step: int | None = None
    stage: int | None = None  # DeepSpeed: the ZeRO stage
    weights: str | None = None  # DeepSpeed: "master" (fp32 partitions), "module" or "universal"
    model_key: str | None = None  # DCP: the part of the app state taken as the model
    # Who saved it, when the folder says: "accelerate", "transformers Trainer", "lightning".
    saved_by: str | None = None
    # accelerate / Trainer: the model's folder in the checkpoint (`pytorch_model_fsdp_0`).
    model_folder: str | None = None
    # Several models side by side (`pytorch_model_fsdp_0`, `_1`, ...): none is chosen.
    separate: tuple[str, ...] = ()
    left_out_tensors: int = 0  # tensors that are not the model's (optimizer state, ...)
    left_out_bytes: int = 0
    left_out_parts: tuple[str, ...] = ()  # e.g. ("optim", "train_state")
    other_items: int = 0  # non-tensor items (pickled objects), never read
    other_bytes: int = 0
    findings: tuple[Finding, ...] = field(default=(), compare=False)
    # Output dtype a tensor is written in unless --dtype says otherwise (DeepSpeed master
    # weights: floating buffers in fp32, as zero_to_fp32.py writes them).
    dtypes: dict[str, str] = field(default_factory=dict, compare=False)
    # DeepSpeed: the other copy of the weights the folder holds, not read (a universal
    # checkpoint beside the partitions, or the reverse): --zero-weights choice -> where.
    other_weights: dict[str, str] = field(default_factory=dict)
    # A framework's own facts for the report (Megatron: its backends, iteration, the
    # architecture its training arguments give), JSON values only.
    extra: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """The `"layout"` object of the JSON report."""
        document: dict[str, object] = {
            "framework": self.framework,
            "world_size": self.world_size,
        }
        optional = {
            "serialization": self.serialization,
            "tag": self.tag,
            "step": self.step,
            "stage": self.stage,
            "weights": self.weights,
            "model_key": self.model_key,
            "saved_by": self.saved_by,
            "model_folder": self.model_folder,
        }
        document.update({key: value for key, value in optional.items() if value is not None})
        if self.separate:
            document["separate"] = list(self.separate)
        if self.other_weights:
            document["other_weights"] = dict(self.other_weights)
        document.update(self.extra)
        document["left_out"] = {
            "tensors": self.left_out_tensors,
            "tensor_bytes": self.left_out_bytes,
            "parts": list(self.left_out_parts),
            "other_items": self.other_items,
            "other_bytes": self.other_bytes,
        }
        return document


def weights_note(layout: Mapping[str, object] | None) -> str | None:
    """One line saying which copy of a DeepSpeed folder's weights was read, when the folder
    holds another (the `"layout"` object's `other_weights`); None otherwise."""
    others = layout.get("other_weights") if layout is not None else None
    if not isinstance(others, dict) or not others or layout is None:
        return None
    unread = "; ".join(
        f"the {kind} weights in {where} (what --zero-weights {kind} reads)"
        for kind, where in others.items()
    )
    return (
        f"read: the {layout.get('weights')} weights of tag {layout.get('tag')}; not read: {unread}"
    )
