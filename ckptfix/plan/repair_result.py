"""The checkpoint a RepairPlan would leave, checked as `inspect` checks a checkpoint.

`result_checkpoint` builds, from what was read, the Checkpoint that the repaired folder (or
file) will be: the kept files under their new names with the tensors they keep and the
header metadata they will have, the index as planned, the config as it is. `checks.run`
over it gives the findings `ckptfix inspect OUT` would report; each one at warning level or
above is a refusal, so fix never writes a checkpoint that still has one (but for the sizes
of tensors, core.fixes.LEFT_AS_IS, which no repair changes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from ckptfix import checks
from ckptfix.core.checkpoint import Checkpoint, FileRecord, IndexRecord
from ckptfix.core.findings import Severity, split_message
from ckptfix.core.fixes import LEFT_AS_IS, default_fix
from ckptfix.formats.index import ShardIndex
from ckptfix.layouts.choice import choose
from ckptfix.layouts.names import FolderLayout, layout_of
from ckptfix.plan.repair import FindingAction, KeptFile, Refusal, RepairPlan


def _kept_record(record: FileRecord, kept: KeptFile, label: str) -> FileRecord:
    """A kept file as it will be: renamed, its stale copies gone, `"format"` added."""
    read = record.read
    assert read is not None  # the plan keeps only files that were read
    if label == record.label and not kept.rewritten:
        return record
    tensors = read.tensors
    if kept.dropped:
        wanted = set(kept.tensors)
        tensors = tuple(tensor for tensor in tensors if tensor.name in wanted)
    metadata = read.metadata
    if kept.add_format:
        metadata = {**(metadata or {}), "format": "pt"}
    changed = replace(read, label=label, tensors=tensors, metadata=metadata)
    return replace(record, label=label, read=changed, size=sum(t.nbytes for t in tensors))


def _layout(names: list[str], indexed: set[str]) -> FolderLayout:
    """The result's families, as load_folder finds them (a loose file an index lists
    belongs to that checkpoint)."""
    layout = layout_of(sorted(names))
    for family in layout.families:
        if family.stem == "loose":
            family.files = [name for name in family.files if name not in indexed]
    return layout


def result_checkpoint(checkpoint: Checkpoint, plan: RepairPlan) -> Checkpoint:
    """The Checkpoint the plan leaves (see the module docstring)."""
    root = checkpoint.path
    if plan.single_file:
        kept = plan.kept_files[0]
        return replace(checkpoint, files=(_kept_record(checkpoint.files[0], kept, root),))
    records = {record.label: record for record in checkpoint.files}
    files = tuple(
        _kept_record(
            records[os.path.join(root, kept.source)], kept, os.path.join(root, kept.target)
        )
        for kept in plan.kept_files
    )
    indexes, exists, shards = [], {}, {}
    for family in plan.families:
        if family.index is None:
            continue
        label = os.path.join(root, family.index.file)
        index = ShardIndex(label, dict(family.index.weight_map), dict(family.index.metadata))
        indexes.append(IndexRecord(label, 0, family.key, index=index))
        shards[family.index.file] = index.shard_names
        exists.update({os.path.join(root, shard): True for shard in index.shard_names})
    names = [kept.target for kept in plan.kept_files if "/" not in kept.target]
    names += list(shards) + (["config.json"] if checkpoint.config is not None else [])
    layout = _layout(names, {shard for listed in shards.values() for shard in listed})
    return replace(
        checkpoint,
        files=files,
        indexes=tuple(indexes),
        layout=layout,
        exists=exists,
        choice=choose(layout, shards),
    )


def result_check(
    checkpoint: Checkpoint, plan: RepairPlan, max_shard: int
) -> tuple[tuple[Refusal, ...], tuple[FindingAction, ...]]:
    """Every finding at warning level or above that the repaired checkpoint would have: as
    refusals, but for the sizes of tensors (LEFT_AS_IS), which no repair changes and which
    are returned second, as findings left as they are."""
    result = result_checkpoint(checkpoint, plan)
    found = checks.run(result, checks.CheckOptions(max_shard=max_shard))
    renamed = _renamed_back(checkpoint.path, plan)
    refusals, remaining = [], []
    for item in found:
        if item.severity.rank < Severity.WARNING.rank:
            continue
        file = renamed.get(item.file, item.file) if item.file else None
        if item.code in LEFT_AS_IS:
            action = f"left as it is: {default_fix(item.code, checkpoint.path)}"
            remaining.append(
                FindingAction(item.code, item.severity.value, file, item.message, "keep", action)
            )
            continue
        what, rule, fix = split_message(item.message)
        way_out = fix or default_fix(item.code, checkpoint.path).removeprefix("none: ")
        what = f"the repaired checkpoint would still have this: {what}"
        refusals.append(Refusal(item.code, file, what, way_out, item.tensors, rule or None))
    return tuple(refusals), tuple(remaining)


def _renamed_back(root: str, plan: RepairPlan) -> Mapping[str, str]:
    """Result label -> source label for the renamed files (refusals name files that exist)."""
    return {
        os.path.join(root, kept.target): os.path.join(root, kept.source)
        for kept in plan.kept_files
        if kept.target != kept.source
    }
