"""Checks: functions from a Checkpoint (what was read) to findings. No I/O but the tensor
bytes that `--hash` and `--scan-values` ask for; no terminal."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from ckptfix.checks import config, folder, tensors, training, values
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding, finding
from ckptfix.core.memory import paused_gc
from ckptfix.formats import FORMATS


@dataclass(frozen=True)
class CheckOptions:
    """What the checks are asked to do beyond reading metadata."""

    max_shard: int
    hash_values: bool = False
    scan_values: bool = False


def run(checkpoint: Checkpoint, options: CheckOptions) -> list[Finding]:
    """Every finding about a checkpoint, errors first."""
    with paused_gc():  # passes over every tensor, which may be 1,000,000
        return _run(checkpoint, options)


def _run(checkpoint: Checkpoint, options: CheckOptions) -> list[Finding]:
    found = _read_errors(checkpoint)
    for record in checkpoint.files:
        if record.read is not None:
            found += FORMATS.named(record.read.format).checks(record.read)
    if checkpoint.kind == "folder":
        found += folder.folder_findings(checkpoint)
    found += training.training_findings(checkpoint)
    gguf = _gguf_checks(checkpoint)
    if gguf is not None:
        found += gguf.split_findings(checkpoint)
    all_tensors = checkpoint.model_tensors
    nested = any(
        getattr(record.read, "nested_key", None) is not None  # a torch file's (PickleFile)
        for record in checkpoint.chosen_files
    ) or lightning_saved(checkpoint)
    found += tensors.wrapper_prefix_findings(all_tensors, training_checkpoint=nested)
    found += tensors.tensor_findings(all_tensors, options.max_shard)
    if options.hash_values:
        groups = values.content_groups(all_tensors, checkpoint.source)
        found += values.duplicate_content_findings(groups)
    if options.scan_values:
        found += values.non_finite_findings(all_tensors, checkpoint.source)
        if gguf is not None:
            found = gguf.zero_findings(checkpoint, found)
    if checkpoint.config is not None and checkpoint.config.config is not None:
        found += config.config_findings(checkpoint, hashed=options.hash_values)
    return sorted(found, key=lambda item: -item.severity.rank)


def lightning_saved(checkpoint: Checkpoint) -> bool:
    """A folder Lightning's FSDP or DeepSpeed strategy saved: the names are the
    LightningModule's, `model.` included (a wrapper prefix, as in its `.ckpt` files)."""
    return checkpoint.training is not None and checkpoint.training.saved_by == "lightning"


def _gguf_checks(checkpoint: Checkpoint) -> ModuleType | None:
    """checks.gguf, imported only for a checkpoint with GGUF files (inspect of anything else
    does not pay for it)."""
    if not any(record.format == "gguf" for record in checkpoint.files):
        return None
    from ckptfix.checks import gguf

    return gguf


def _read_errors(checkpoint: Checkpoint) -> list[Finding]:
    """Files that could not be read, as findings (their error's own code)."""
    found = [
        finding(record.error.code or "corrupt-file", record.error.detail(), file=record.label)
        for record in checkpoint.files
        if record.error is not None
    ]
    found += [
        finding("corrupt-file", record.error.detail(), file=record.label)
        for record in checkpoint.indexes
        if record.error is not None
    ]
    if checkpoint.config is not None and checkpoint.config.error is not None:
        label = checkpoint.config.label
        found.append(finding("corrupt-file", checkpoint.config.error.detail(), file=label))
    return found


__all__ = ["CheckOptions", "run"]
