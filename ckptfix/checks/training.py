"""Findings of a training checkpoint folder (DCP, DeepSpeed): the problems its loader found
(missing or truncated rank files, chunks that do not tile a tensor, a tag pointing nowhere)
and what a conversion leaves out (optimizer state, non-tensor items), with its bytes."""

from __future__ import annotations

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding, finding
from ckptfix.core.sizes import format_size
from ckptfix.core.training import TrainingLayout


def training_findings(checkpoint: Checkpoint) -> list[Finding]:
    layout = checkpoint.training
    if layout is None:
        return []
    found = list(layout.findings)
    left_out = _left_out(layout)
    if left_out is not None:
        found.append(finding("training-state", left_out, file=checkpoint.path))
    return found


def _left_out(layout: TrainingLayout) -> str | None:
    parts = []
    if layout.left_out_tensors:
        parts.append(
            f"{layout.left_out_tensors:,} tensor(s) of training state "
            f"({format_size(layout.left_out_bytes)}, e.g. optimizer moments)"
        )
    if layout.other_items:
        parts.append(
            f"{layout.other_items:,} non-tensor item(s) ({format_size(layout.other_bytes)}, "
            "never unpickled)"
        )
    if not parts:
        return None
    where = f" in {', '.join(layout.left_out_parts)}" if layout.left_out_parts else ""
    model = f" (the model is {layout.model_key!r})" if layout.model_key else ""
    return (
        f"{' and '.join(parts)}{where} are not part of the model{model} and are left out "
        "by `ckptfix convert` (keep the original folder to resume training)"
    )
