"""Each finding of the source against a RepairPlan: what fix does about it (`repair`), that
fix cannot repair it (`refuse`), or that it is left as it is (`keep`: info, and the sizes
of tensors, core.fixes.LEFT_AS_IS); and the `fix`
text every finding carries in reports: the command that repairs it, or why none can."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import replace

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding, Severity
from ckptfix.core.fixes import LEFT_AS_IS, Annotated, default_fix, fix_action
from ckptfix.io.urls import is_url
from ckptfix.plan.repair import FamilyPlan, FindingAction, KeptFile, Move, Refusal, RepairPlan

_INDEX_CODES = (
    "index-missing-file",
    "index-missing-tensor",
    "index-unlisted-tensor",
    "index-total-size",
)


class _Context:
    """A plan looked up by file: the family, kept file and move of each name."""

    def __init__(self, root: str, plan: RepairPlan) -> None:
        self.root = root
        self.plan = plan
        self.moves = {move.source: move for move in plan.moves}
        self.kept: dict[str, tuple[KeptFile, FamilyPlan]] = {}
        self.indexes: dict[str, FamilyPlan] = {}
        for family in plan.families:
            for kept in family.files:
                self.kept[kept.source] = (kept, family)
            if family.index is not None:
                self.indexes[family.index.file] = family

    def name(self, label: str | None) -> str:
        if label is None:
            return ""
        return (
            os.path.relpath(label, self.root)
            if not self.plan.single_file
            else os.path.basename(label)
        )

    def family_of(self, label: str | None) -> FamilyPlan | None:
        name = self.name(label)
        if name in self.indexes:
            return self.indexes[name]
        found = self.kept.get(name)
        return found[1] if found is not None else None


def _index_action(family: FamilyPlan | None) -> str | None:
    if family is None:
        return None
    renamed = [kept for kept in family.files if kept.how == "renamed" or kept.target != kept.source]
    parts = []
    if renamed:
        pairs = ", ".join(f"{kept.source} → {kept.target}" for kept in renamed[:3])
        more = f" and {len(renamed) - 3} more" if len(renamed) > 3 else ""
        parts.append(f"renumber the shards ({pairs}{more})")
    if family.index is not None and family.index.write:
        parts.append(f"write {family.index.file} anew from the shard headers")
    elif family.index is None:
        parts.append("keep the checkpoint as one file, without an index")
    return "; ".join(parts) or None


def _moved(move: Move) -> str:
    return f"take {move.source} out ({move.reason})"


def _duplicate_action(item: Finding, context: _Context) -> str | None:
    """A name stored twice: which copy stays, and what happens to the files with the
    others."""
    names = set(item.tensors)
    holders = [kept.target for kept, _ in context.kept.values() if names & set(kept.tensors)]
    if not holders:
        return None
    family = next(iter(context.kept.values()))[1]
    index = family.index.file if family.index is not None else "the index"
    parts = [f"keep the copy in {', '.join(holders)}, the one {index} points to"]
    for kept, _ in context.kept.values():
        if names & set(kept.dropped):
            stale = len(names & set(kept.dropped))
            parts.append(
                f"rewrite {kept.source} without its stale cop{'y' if stale == 1 else 'ies'}"
            )
    parts += [
        f"take {move.source} out"
        for move in context.plan.moves
        if names & set(move.stale) and move.source not in context.kept
    ]
    return "; ".join(dict.fromkeys(parts))


def _file_action(item: Finding, context: _Context) -> str | None:
    """What happens to the finding's own file: taken out, renamed into the index, or its
    header rewritten."""
    name = context.name(item.file)
    move = context.moves.get(name)
    found = context.kept.get(name)
    if item.code == "missing-format-metadata" and found is not None and found[0].add_format:
        return f'rewrite the header of {name} with "format": "pt" (tensor bytes unchanged)'
    if item.code == "duplicate-name":
        return _duplicate_action(item, context) or (_moved(move) if move is not None else None)
    if found is not None and item.code in ("orphan-file", "shadowed-shards"):
        kept, family = found
        index = family.index.file if family.index is not None else "the checkpoint"
        how = "rewritten without its stale copies" if kept.dropped else "kept"
        return f"keep {name} in {index} as {kept.target} ({how})"
    if move is not None:
        return _moved(move)
    return None


def _single_of(family: FamilyPlan) -> str:
    """The family's one-file name, from its key (`stem|variant|ext`)."""
    stem, variant, ext = family.key.split("|")
    return f"{stem}.{variant}.{ext}" if variant else f"{stem}.{ext}"


def _code_action(item: Finding, context: _Context) -> str | None:
    """Findings about a family or the folder as a whole."""
    if item.code == "mixed-formats":
        others = [move.source for move in context.plan.moves if move.reason.startswith("another")]
        return f"take the other weight families out ({', '.join(others)})" if others else None
    family = context.family_of(item.file)
    if item.code == "shadowed-shards" and family is not None:
        single = _single_of(family)
        if single in context.moves:
            return _moved(context.moves[single])
        if single in context.kept:
            kept = context.kept[single][0]
            return f"keep {single} in the index as {kept.target} (it holds tensors no shard has)"
    return _index_action(family)


_FAMILY_CODES = (*_INDEX_CODES, "shard-numbering", "shadowed-shards", "mixed-formats")


def _action(item: Finding, context: _Context) -> str | None:
    if item.code in _FAMILY_CODES:
        return _code_action(item, context) or _file_action(item, context)
    return _file_action(item, context)


def _refusal_for(item: Finding, refusals: Sequence[Refusal]) -> Refusal | None:
    for refusal in refusals:
        if refusal.code != item.code:
            continue
        if refusal.file == item.file or None in (refusal.file, item.file):
            return refusal
        if set(refusal.tensors) & set(item.tensors):
            return refusal
    return None


def _verdict(item: Finding, context: _Context) -> FindingAction:
    plan = context.plan

    def made(verdict: str, action: str) -> FindingAction:
        severity = item.severity.value
        return FindingAction(item.code, severity, item.file, item.message, verdict, action)

    refusal = _refusal_for(item, plan.refusals)
    if refusal is not None:
        return made("refuse", refusal.fix)
    action = _action(item, context)
    if action is None and plan.refused:  # not planned: its family is refused
        action = fix_action(item.code)
    if action is not None:
        return made("repair", action)
    if item.severity is Severity.INFO or item.code in LEFT_AS_IS:
        return made("keep", f"left as it is: {default_fix(item.code, plan.path, item.fix)}")
    if plan.checked:  # the result was checked and does not have it
        return made(
            "repair", "the other repairs remove it: the repaired checkpoint does not have it"
        )
    return made("refuse", default_fix(item.code, plan.path, item.fix).removeprefix("none: "))


def verdicts(
    checkpoint: Checkpoint, findings: Sequence[Finding], plan: RepairPlan
) -> tuple[FindingAction, ...]:
    """What fix does about each finding of the source."""
    context = _Context(checkpoint.path, plan)
    return tuple(_verdict(item, context) for item in findings)


def fix_command(path: str) -> str:
    """`ckptfix fix PATH -o OUT (or --in-place)`, PATH quoted for a shell where it needs it;
    a URL is repaired from a local copy."""
    if is_url(path):
        return "ckptfix fix on a local copy (-o OUT or --in-place)"
    return f"ckptfix fix {shlex.quote(path)} -o OUT (or --in-place)"


def fix_text(action: FindingAction, plan: RepairPlan) -> str:
    """A finding's `fix`: `ckptfix fix PATH -o OUT (or --in-place): <what it does>`, another
    command, or `none: why`. While fix refuses the checkpoint for another finding, the
    repair waits for that one."""
    if action.verdict == "repair":
        text = f"{fix_command(plan.path)}: {action.action}"
        if plan.refused:
            codes = ", ".join(dict.fromkeys(refusal.code for refusal in plan.refusals))
            text += f", once what it cannot repair ({codes}) is resolved"
        return text
    if action.verdict == "keep":
        return action.action.removeprefix("left as it is: ")
    text = action.action
    return text if text.startswith(("ckptfix ", "none: ")) else f"none: {text}"


def annotate(checkpoint: Checkpoint, findings: Sequence[Finding], max_shard: int) -> Annotated:
    """The findings with their `fix`, from the plan `ckptfix fix` would make for them."""
    if not findings:
        return Annotated(list(findings))
    from ckptfix.plan.repair_plan import plan_repair

    plan = plan_repair(checkpoint, findings, max_shard=max_shard)
    annotated = [
        replace(item, fix=fix_text(action, plan))
        for item, action in zip(findings, plan.findings, strict=True)
    ]
    if plan.refused:
        codes = tuple(dict.fromkeys(refusal.code for refusal in plan.refusals))
        return Annotated(annotated, 0, codes)
    return Annotated(annotated, plan.count("repair"))
