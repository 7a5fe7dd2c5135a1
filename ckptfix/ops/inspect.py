"""`inspect`: load a checkpoint and report every problem found (read-only)."""

from __future__ import annotations

import os

from ckptfix import checks
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding
from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.ops.load import load
from ckptfix.ops.report import FileSummary, Report


def inspect(
    path: str | os.PathLike[str],
    *,
    max_shard: int = DEFAULT_MAX_SHARD,
    hash_values: bool = False,
    scan_values: bool = False,
    key: str = "auto",
    zero_weights: str = "master",
) -> Report:
    """Inspect a checkpoint file or model folder without modifying it.

    Tensor data is read only with `hash_values` (duplicate-content) or `scan_values` (non-finite).
    """
    checkpoint = load(path, key=key, zero_weights=zero_weights)
    options = checks.CheckOptions(
        max_shard=max_shard, hash_values=hash_values, scan_values=scan_values
    )
    return report_of(checkpoint, checks.run(checkpoint, options))


def report_of(checkpoint: Checkpoint, findings: list[Finding]) -> Report:
    files = [
        FileSummary(record.label, record.format, record.size, len(record.tensors), record.metadata)
        for record in checkpoint.files
    ]
    files += [
        FileSummary(
            record.label,
            "index",
            record.size,
            len(record.index.weight_map) if record.index is not None else 0,
        )
        for record in checkpoint.indexes
    ]
    return Report(
        path=checkpoint.path,
        format=checkpoint.kind,
        files=tuple(files),
        tensors=checkpoint.tensors,
        findings=tuple(findings),
        layout=checkpoint.training.to_dict() if checkpoint.training is not None else None,
    )
