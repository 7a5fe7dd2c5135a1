"""Human output of `ckptfix fix`: each finding and what fix does about it, what happens to
each weight file, then what was written (or that nothing was). Every piece of text goes in
through render.text()."""

from __future__ import annotations

import os

from rich.table import Table
from rich.text import Text

from ckptfix.cli.render import _console, text
from ckptfix.core.sizes import format_size
from ckptfix.ops.fix import FixResult
from ckptfix.plan.repair import ASIDE, RepairPlan

_VERDICT = {"repair": ("✓", "green"), "refuse": ("✗", "bold red"), "keep": ("i", "cyan")}


def _shown(plan: RepairPlan, label: str | None) -> str:
    if label is None:
        return "-"
    if plan.single_file:
        return os.path.basename(label)
    return os.path.relpath(label, plan.path)


def _findings_table(plan: RepairPlan) -> Table:
    table = Table(title=text(f"Repair plan for {plan.path}"), title_justify="left")
    for column in ("", "finding", "file", "what fix does"):
        table.add_column(column)
    for item in plan.findings:
        mark, style = _VERDICT[item.verdict]
        table.add_row(
            text(mark, style=style), item.code, text(_shown(plan, item.file)), text(item.action)
        )
    return table


def _file_lines(plan: RepairPlan, in_place: bool) -> list[Text]:
    lines = []
    for family in plan.families:
        for kept in family.files:
            line = f"{kept.how}: {kept.source}"
            if kept.target != kept.source:
                line += f" → {kept.target}"
            why = []
            if kept.add_format:
                why.append('"format": "pt" added')
            if kept.dropped:
                why.append(f"{len(kept.dropped)} stale copies left out")
            if why:
                line += f" ({', '.join(why)})"
            lines.append(text(f"  {line}"))
        index = family.index
        if index is not None:
            state = "written anew" if index.write else "kept as it is"
            total = index.metadata.get("total_size")
            lines.append(text(f"  index: {index.file}, {state} (total_size {total:,})"))
    return lines + _move_lines(plan, in_place)


def _move_lines(plan: RepairPlan, in_place: bool) -> list[Text]:
    lines = []
    rewritten = {kept.source for kept in plan.kept_files}
    for move in plan.moves:
        if move.source in rewritten and not in_place:
            continue  # its rewrite stands in for it in OUT (the line above says so)
        where = f" → {ASIDE}/{move.aside}" if in_place else ""
        verb = "moved aside" if in_place else "left out"
        if move.source in rewritten:
            verb = "original moved aside"
        lines.append(text(f"  {verb}: {move.source}{where} ({move.reason})", style="yellow"))
    return lines


def _entry_lines(plan: RepairPlan, in_place: bool) -> list[Text]:
    lines = []
    if plan.copied:
        verb = "kept" if in_place else "copied"
        lines.append(text(f"  {verb}: " + ", ".join(plan.copied)))
    for name, reason in plan.left_out.items():
        lines.append(text(f"  left out ({reason}): {name}", style="yellow"))
    return lines


def _summary(plan: RepairPlan) -> Text:
    repaired, refused = plan.count("repair"), plan.count("refuse")
    kept = plan.count("keep") + len(plan.remaining)
    line = f"{repaired} finding(s) repaired, {refused} cannot be, {kept} left as they are"
    if plan.refused:
        codes = ", ".join(dict.fromkeys(refusal.code for refusal in plan.refusals))
        return text(f"{line} → refused ({codes}): nothing is written", style="bold red")
    return text(line, style="bold")


def _written_lines(result: FixResult, in_place: bool) -> list[Text]:
    written = result.written
    assert written is not None
    rewritten = sum(1 for kept in result.plan.kept_files if kept.rewritten)
    how = "linked" if in_place else "copied"
    lines = [
        text(
            f"wrote {written.path}: {len(written.files)} file(s), {written.bytes:,} bytes "
            f"({format_size(written.bytes)}); {rewritten} shard(s) rewritten and verified "
            f"against their sources, the rest {how} as they are",
            style="green",
        )
    ]
    lines += [
        text(f"replaced: {path} (its header rewritten; every tensor byte kept)", style="yellow")
        for path in written.replaced
    ]
    lines += [text(f"moved: {old} → {new}", style="yellow") for old, new in result.moved]
    return lines


def fix_result(result: FixResult, *, in_place: bool) -> None:
    """The plan, then what was written, or why nothing was."""
    console = _console()
    plan = result.plan
    if plan.findings:
        console.print(_findings_table(plan))
    else:
        console.print(text(f"{plan.path}: no findings"))
    for item in plan.remaining:
        where = f"{_shown(plan, item.file)}: " if item.file else ""
        stays = f"! {item.code} stays: {where}{item.message}"
        console.print(text(stays, style="yellow"), soft_wrap=True)
    for line in _file_lines(plan, in_place) + _entry_lines(plan, in_place):
        console.print(line, soft_wrap=True)
    for refusal in plan.refusals:
        where = f"{_shown(plan, refusal.file)}: " if refusal.file else ""
        refused = f"✗ {refusal.code}: {where}{refusal.what} ({refusal.fix})"
        console.print(text(refused, style="red"), soft_wrap=True)
    console.print(_summary(plan))
    if result.written is not None:
        for line in _written_lines(result, in_place):
            console.print(line, soft_wrap=True)
    elif not plan.refused:
        done = "dry run: nothing was written"
        if in_place and not plan.changes:
            done = "nothing to repair: nothing was written"
        console.print(text(done, style="bold"))
