"""`inspect`: load a checkpoint and report every problem found (read-only)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from ckptfix import checks
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding
from ckptfix.core.fixes import Annotated
from ckptfix.core.memory import paused_gc
from ckptfix.core.sizes import DEFAULT_MAX_SHARD, shard_size
from ckptfix.formats.base import ReadOptions
from ckptfix.layouts.diffusers import components
from ckptfix.ops.load import load
from ckptfix.ops.report import FileSummary, Report


def inspect(
    path: str | os.PathLike[str],
    *,
    max_shard: int | str = DEFAULT_MAX_SHARD,
    hash_values: bool = False,
    scan_values: bool = False,
    manifest: str | os.PathLike[str] | None = None,
    read: ReadOptions | None = None,
) -> Report:
    """Inspect a checkpoint file or model folder without modifying it.

    Tensor data is read only with `hash_values` (duplicate-content), `scan_values`
    (non-finite) or `manifest` (the tensors it lists, checked against their digests).
    """
    limit = shard_size(max_shard)
    options = checks.CheckOptions(max_shard=limit, hash_values=hash_values, scan_values=scan_values)
    parts = components(os.fspath(path)) if os.path.isdir(path) else []
    if parts and manifest is None:
        return _pipeline_report(os.fspath(path), parts, options, read)
    with load(path, read) as checkpoint:
        with paused_gc():  # the checks and the report: passes over every tensor
            found = checks.run(checkpoint, options)
            # The report inspect shows: each finding with its fix (a manifest's findings
            # come after, with their code's).
            report = report_of(checkpoint, found, max_shard=limit).with_fixes()
        if manifest is not None:
            from ckptfix.ops.manifest import read_manifest, verified_report

            report = verified_report(checkpoint, report, read_manifest(manifest))
    return with_remote(report, checkpoint)


def with_remote(report: Report, checkpoint: Checkpoint) -> Report:
    """The report with what reading a URL took (requests, bytes), counted to this point."""
    if checkpoint.remote is None:
        return report
    return replace(report, remote=checkpoint.remote.session.stats())


def _pipeline_report(
    root: str, parts: list[str], options: checks.CheckOptions, read: ReadOptions | None
) -> Report:
    """A diffusers pipeline: each component (named by model_index.json) inspected as the
    model folder it is, and reported together."""
    reports = []
    for part in parts:
        with load(os.path.join(root, part), read) as checkpoint:
            found = checks.run(checkpoint, options)
            reports.append(report_of(checkpoint, found, max_shard=options.max_shard).with_fixes())
    findings = sorted(
        (item for report in reports for item in report.findings),
        key=lambda item: -item.severity.rank,
    )
    return Report(
        path=root,
        format="diffusers-pipeline",
        files=tuple(item for report in reports for item in report.files),
        tensors=tuple(tensor for report in reports for tensor in report.tensors),
        findings=tuple(findings),
        repairable=sum(report.repairable for report in reports),
        fix_refused=tuple(dict.fromkeys(code for report in reports for code in report.fix_refused)),
        checkpoint={
            "components": {
                part: report.checkpoint for part, report in zip(parts, reports, strict=True)
            }
        },
    )


def _annotated(checkpoint: Checkpoint, max_shard: int, findings: Sequence[Finding]) -> Annotated:
    """The findings with their `fix`; the repair planner is imported only when there are
    findings to plan for (a clean inspect loads no planner)."""
    if not findings:
        return Annotated(list(findings))
    from ckptfix.plan.repair_verdicts import annotate

    return annotate(checkpoint, findings, max_shard)


def report_of(
    checkpoint: Checkpoint, findings: list[Finding], *, max_shard: int = DEFAULT_MAX_SHARD
) -> Report:
    """The report of a checkpoint: its files, the tensors its loader loads, and the findings,
    each given its `fix` (what `ckptfix fix` would do about it, or what else repairs it) when
    the report is shown (`Report.with_fixes`), not here: a rewrite or a hash shows none."""
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
        tensors=checkpoint.model_tensors,
        findings=tuple(findings),
        annotator=partial(_annotated, checkpoint, max_shard),
        layout=checkpoint.training.to_dict() if checkpoint.training is not None else None,
        checkpoint=checkpoint.choice.to_dict() if checkpoint.choice is not None else None,
    )
