"""Whether a rewrite keeps every name its source declares: checked before anything is
written, as the verification of names (the writers then verify that what they wrote reads
back as the plan: every name, shared storage and record).

A name the source declares (a stored tensor, or one its ckptfix.dropped record dropped, see
plan.alias_record) that --exclude does not leave out must come out under its output name
as a tensor written from its own source (or its copy, with --clone), as a name on the
storage of such a tensor (`ShardPlan.shared`, a `.bin`), or in the output's record as the
name of one (`ShardPlan.dropped`); a record entry made by `dedupe --by-content` may name a
separately stored tensor of equal bytes (compared when they were grouped).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter, is_

from ckptfix.core.tensor import TensorInfo
from ckptfix.plan.select import Selection
from ckptfix.plan.shards import ShardPlan

_NAME, _SOURCE = attrgetter("name"), attrgetter("source")


def _identity(tensor: TensorInfo) -> tuple[object, ...]:
    """What makes two names one tensor: everything but the name."""
    return (
        tensor.file,
        tensor.storage,
        tensor.byte_range,
        tensor.shape,
        tensor.strides,
        tensor.dtype,
        tensor.spread,
    )


def missing_name(
    declared: Iterable[TensorInfo], selection: Selection, plan: ShardPlan
) -> str | None:
    """The first declared name the plan loses or points at another tensor, described;
    None when every one is kept."""
    declared = tuple(declared)
    if _each_itself(declared, selection, plan):
        return None
    written = {tensor.name: tensor.source for tensor in selection.tensors}
    stored = plan.weight_map
    excluded = set(selection.excluded)
    for tensor in declared:
        if tensor.name in excluded:
            continue
        name = selection.renamed.get(tensor.name, tensor.name)
        target = plan.shared.get(name) or plan.dropped.get(name) or name
        if name not in stored and name not in plan.dropped:
            return f"{tensor.name!r} would be in no output file and in no record"
        source = written.get(target)
        if source is None or target not in stored:
            return f"{tensor.name!r} would name {target!r}, which is not written"
        same = _identity(source) == _identity(tensor)
        equal = name in selection.merged and (source.dtype, source.shape) == (
            tensor.dtype,
            tensor.shape,
        )
        if not (same or equal):
            return f"{tensor.name!r} would name {target!r}, another tensor"
    return None


def _each_itself(declared: Sequence[TensorInfo], selection: Selection, plan: ShardPlan) -> bool:
    """Whether the plan writes each declared tensor itself, under its own name (unique), in
    order, and stores every name: what a reshard plans, and most conversions. For such a
    plan the check above finds each name kept; this finds so in a few passes in C (over
    1,000,000 names, the check by name takes seconds)."""
    if selection.excluded or selection.renamed or plan.shared or plan.dropped:
        return False
    names = list(map(_NAME, declared))
    return (
        len(selection.tensors) == len(declared)
        and all(map(is_, map(_SOURCE, selection.tensors), declared))
        and list(map(_NAME, selection.tensors)) == names
        and len(set(names)) == len(names)
        and (
            list(chain.from_iterable(shard.tensors for shard in plan.shards)) == names
            or all(map(plan.weight_map.__contains__, names))
        )
    )
