"""`plan_repair`: what `ckptfix fix` would do to a checkpoint, as a RepairPlan (no I/O).

A folder keeps the weight families of the kind its loader loads (`model*.safetensors`,
variants included), each repaired from its shard headers (plan.repair_family); every other
family is taken out. A single safetensors file only ever needs `"format"`. Then the result
is checked as `inspect` would check it (plan.repair_result): a finding at warning level
that would remain is refused, so fix either leaves a checkpoint with no such finding or
writes nothing. Last, each finding of the source gets its verdict (plan.repair_verdicts).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import replace

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding, name_list, split_message
from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.layouts.diffusers import no_weights_message
from ckptfix.layouts.names import Family
from ckptfix.plan.repair import FamilyPlan, KeptFile, Move, Refusal, RepairPlan, read_refusal
from ckptfix.plan.repair_family import index_of, members, plan_family


def plan_repair(
    checkpoint: Checkpoint,
    findings: Sequence[Finding],
    *,
    taken: Collection[str] = (),
    max_shard: int = DEFAULT_MAX_SHARD,
) -> RepairPlan:
    """The repair of `checkpoint` (its `findings` as checks.run found them). `taken` are
    the paths already inside the aside folder, which moved files must not overwrite."""
    from ckptfix.plan.repair_result import result_check
    from ckptfix.plan.repair_verdicts import verdicts

    plan = _plan(checkpoint, taken)
    if not plan.refused:
        refusals, remaining = result_check(checkpoint, plan, max_shard)
        plan = replace(plan, refusals=refusals, remaining=remaining, checked=True)
    return replace(plan, findings=verdicts(checkpoint, findings, plan))


def _plan(checkpoint: Checkpoint, taken: Collection[str]) -> RepairPlan:
    path = checkpoint.path
    convert = f"`ckptfix convert {path} -o OUT` writes its model as safetensors"
    if checkpoint.training is not None:
        what = f"folder is a {checkpoint.kind} training checkpoint, which fix does not rewrite"
        return RepairPlan(
            path, False, refusals=(Refusal("unsupported-format", path, what, convert),)
        )
    if checkpoint.kind != "folder":
        return _single_file(checkpoint)
    refusal = _choice_refusal(checkpoint)
    if refusal is not None:
        return RepairPlan(path, False, refusals=(refusal,))
    return _folder(checkpoint, taken)


def _single_file(checkpoint: Checkpoint) -> RepairPlan:
    path = checkpoint.path
    record = checkpoint.files[0]
    name = os.path.basename(path)
    if record.read is None:
        return RepairPlan(path, True, refusals=(read_refusal(path, record.error),))
    if record.format != "safetensors":
        what = f"file is {record.format}, which fix does not rewrite"
        fix = f"`ckptfix convert {path} -o OUT` writes it as safetensors"
        return RepairPlan(path, True, refusals=(Refusal("unsupported-format", path, what, fix),))
    tensors = sorted(record.tensors, key=lambda tensor: tensor.byte_range)
    kept = KeptFile(
        name,
        name,
        tuple(tensor.name for tensor in tensors),
        sum(tensor.nbytes for tensor in tensors),
        add_format="format" not in (record.metadata or {}),
    )
    return RepairPlan(path, True, (FamilyPlan(name, "", (kept,)),))


def _choice_refusal(checkpoint: Checkpoint) -> Refusal | None:
    """A folder fix cannot repair as a whole: several separate checkpoints, none at all, or
    a checkpoint that is not safetensors."""
    path, choice = checkpoint.path, checkpoint.choice
    if len(choice.separate) > 1:
        first = os.path.join(path, choice.separate[0])
        what = (
            f"folder holds {len(choice.separate)} separate checkpoints "
            f"({name_list(list(choice.separate))}), which are never merged"
        )
        fix = f"fix one at a time, e.g. `ckptfix fix {first} -o OUT`"
        return Refusal("several-checkpoints", path, what, fix)
    if choice.family is None:
        message, _, way_out = split_message(no_weights_message(path))
        return Refusal("no-weights", path, message, way_out or "check the path")
    if choice.family.ext != "safetensors":
        what = f"the folder's checkpoint is {choice.label}, which fix does not rewrite"
        fix = f"`ckptfix convert {path} -o OUT` writes it as safetensors"
        return Refusal("unsupported-format", path, what, fix)
    return None


def _folder(checkpoint: Checkpoint, taken: Collection[str]) -> RepairPlan:
    chosen = checkpoint.choice.family
    records = {record.label: record for record in checkpoint.files}
    families = checkpoint.layout.families
    outcomes = [
        plan_family(checkpoint, family, records)
        for family in families
        if family.kind == chosen.kind
    ]
    moves = [move for outcome in outcomes for move in outcome.moves]
    claimed = {
        name
        for family in families
        if family.kind == chosen.kind
        for name in members(checkpoint, family, index_of(checkpoint, family))
    }
    for family in families:
        if family.kind != chosen.kind:
            moves += _other_family(checkpoint, family, chosen, claimed)
    return RepairPlan(
        checkpoint.path,
        False,
        tuple(outcome.plan for outcome in outcomes if outcome.plan is not None),
        _aside_names(moves, taken),
        tuple(refusal for outcome in outcomes for refusal in outcome.refusals),
    )


def _other_family(
    checkpoint: Checkpoint, family: Family, chosen: Family, claimed: Collection[str]
) -> list[Move]:
    """Another weight family: its files, its index and the shards that index lists."""
    why = f"another weight family, {family.label}; the checkpoint is {chosen.label}"
    names = [
        name
        for name in members(checkpoint, family, index_of(checkpoint, family))
        if name not in claimed
    ]
    if family.index is not None:
        names.append(family.index)
    return [Move(name, name, why) for name in names]


def _aside_names(moves: Sequence[Move], taken: Collection[str]) -> tuple[Move, ...]:
    """Each move's path in the aside folder: its own, or with `.2`, `.3`... added when a
    file of that name is there already (from an earlier fix)."""
    used = set(taken)
    placed = []
    for move in moves:
        aside = move.source
        number = 1
        while aside in used:
            number += 1
            aside = f"{move.source}.{number}"
        used.add(aside)
        placed.append(replace(move, aside=aside))
    return tuple(placed)
