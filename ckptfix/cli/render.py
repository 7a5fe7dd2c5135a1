"""Human output with rich. Every piece of text goes in through `text()`: as Text, never
markup (the console parses neither markup nor emoji codes), and shown as core.text.shown
shows it (control characters escaped, no workflow command)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import IO, TYPE_CHECKING, Any, cast

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from ckptfix.cli.render_table import print_table
from ckptfix.core.findings import Severity
from ckptfix.core.sizes import format_size
from ckptfix.core.text import inert_lines, shown
from ckptfix.core.training import weights_note
from ckptfix.ops.report import Report

if TYPE_CHECKING:
    from ckptfix.ops.rewrite import RewriteResult
    from ckptfix.plan.shards import ShardPlan
    from ckptfix.write.parts import CommitCheck
    from ckptfix.write.results import WriteResult

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
_TITLE = {Severity.ERROR: "Errors", Severity.WARNING: "Warnings", Severity.INFO: "Info"}
_MARK = {Severity.ERROR: "✗", Severity.WARNING: "!", Severity.INFO: "i"}
_LEFT_OUT = {"other weight file": "other weight files"}  # plan reason -> heading


# Piped output is never wrapped: a file name split over two lines cannot be grepped or
# copied. Tables and lines take the width they need.
_PIPED_WIDTH = 1_000_000
_HEADING_WIDTH = 80


class _InertLines:
    """The console's stdout. On a terminal (or with FORCE_COLOR) rich wraps long lines, so a
    line can start anywhere in a name: each line written is made inert there too."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file

    def write(self, text: str) -> int:
        return self._file.write(inert_lines(text))

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, flush, encoding, ...
        return getattr(self._file, name)


def _console() -> Console:
    plain: dict[str, Any] = {"highlight": False, "markup": False, "emoji": False}
    plain["file"] = cast(IO[str], _InertLines(sys.stdout))
    console = Console(soft_wrap=False, **plain)
    if not console.is_terminal:
        console = Console(width=_PIPED_WIDTH, soft_wrap=True, **plain)
    return console


def text(value: str, style: str = "") -> Text:
    """`value` (a name, a message, a whole line) as rich Text, shown as core.text.shown
    shows it: the one way text reaches the console."""
    return Text(shown(value), style=style)


def _params(count: int) -> str:
    for scale, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if count >= scale:
            return f"{count:,} ({count / scale:.2f}{unit})"
    return f"{count:,}"


def report(result: Report, *, show_tensors: bool, fail_on: str) -> None:
    result = result.with_fixes()  # each finding's fix, made where it is shown
    console = _console()
    console.print(_summary(result))
    if show_tensors and result.tensors:
        print_table(console, _tensor_table(result), partial(_tensor_rows, result))
    for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO):
        items = [item for item in result.findings if item.severity is severity]
        if not items:
            continue
        console.print()
        console.print(text(f"{_TITLE[severity]} ({len(items)})", style=_STYLE[severity]))
        for item in items:
            head = text(f"  {_MARK[severity]} ", style=_STYLE[severity])
            head.append(item.code, style="bold")
            if item.file:
                head.append("  ")
                head.append_text(text(item.file, style="dim"))
            console.print(head)
            console.print(text(f"    {item.message}"), soft_wrap=True)
            if item.fix is not None:
                console.print(text(f"    fix: {item.fix}", style="dim"), soft_wrap=True)
    console.print(_verdict(result, fail_on))
    if result.remote is not None:
        console.print(text(remote_line(result.remote), style="dim"))


def remote_line(remote: dict[str, int]) -> str:
    """What reading a URL took: `remote: 53 requests, 1.2 MB fetched (1 retry)`."""
    retries = remote.get("retries", 0)
    again = f" ({retries} {'retry' if retries == 1 else 'retries'})" if retries else ""
    fetched = remote.get("bytes_fetched", 0)
    return (
        f"remote: {remote.get('requests', 0)} requests, {fetched:,} bytes "
        f"({format_size(fetched)}) fetched{again}"
    )


def _summary(result: Report) -> Table:
    formats = Counter(item.format for item in result.files)
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("Path", text(result.path))
    summary.add_row("Format", text(result.format))
    if result.layout is not None:
        summary.add_row("Layout", text(_layout(result.layout)))
    file_kinds = ", ".join(f"{count} {fmt}" for fmt, count in sorted(formats.items()))
    summary.add_row("Files", f"{len(result.files)} ({file_kinds})" if result.files else "0")
    summary.add_row("Tensors", f"{result.tensor_count:,}")
    summary.add_row("Parameters", _params(result.parameter_count))
    summary.add_row("Bytes", f"{result.total_bytes:,} ({format_size(result.total_bytes)})")
    dtypes = " · ".join(f"{name} {format_size(size)}" for name, size in result.dtypes.items())
    summary.add_row("Dtypes", dtypes or "-")
    if result.manifest is not None:
        check = result.manifest
        digest = f" (sha256 {check.digest[:12]}…)" if check.digest else ""
        line = f"{check.path}: {check.verified:,} of {check.tensor_count:,} tensors match{digest}"
        summary.add_row("Manifest", text(line))
    return summary


def _layout(layout: dict[str, object]) -> str:
    """`DeepSpeed ZeRO-3 · 2 ranks · tag global_step2 (step 2) · fp32 master weights`."""
    framework = {
        "dcp": "torch.distributed.checkpoint",
        "deepspeed": "DeepSpeed",
        "hf-storage": "torch HuggingFaceStorageWriter, per rank",
        "megatron": "Megatron-Core torch_dist",
    }
    parts = [framework.get(str(layout["framework"]), str(layout["framework"]))]
    if layout.get("stage") is not None:
        parts[0] += f" ZeRO-{layout['stage']}"
    if layout.get("saved_by"):
        folder = f" ({layout['model_folder']})" if layout.get("model_folder") else ""
        parts.append(f"saved by {layout['saved_by']}{folder}")
    if layout.get("world_size") is not None:
        parts.append(f"{layout['world_size']} rank(s)")
    if layout.get("serialization"):
        parts.append(f"{layout['serialization']} chunks")
    if layout.get("tag"):
        parts.append(f"tag {layout['tag']}")
    if layout.get("step") is not None:
        parts.append(f"step {layout['step']}")
    if layout.get("model_key"):
        parts.append(f"model part {layout['model_key']!r}")
    return " · ".join(parts + _weights(layout))


def _weights(layout: dict[str, object]) -> list[str]:
    """The weights read, those not read (a DeepSpeed folder's other copy), what is left out."""
    parts = [f"{layout['weights']} weights"] if layout.get("weights") else []
    others = layout.get("other_weights")
    for kind, where in others.items() if isinstance(others, dict) else ():
        parts.append(f"{kind} weights in {where} not read")
    left = layout.get("left_out")
    if isinstance(left, dict) and (left.get("tensor_bytes") or left.get("other_bytes")):
        total = int(left.get("tensor_bytes", 0)) + int(left.get("other_bytes", 0))
        parts.append(f"{format_size(total)} of training state left out")
    return parts


def _tensor_table(result: Report) -> Table:
    """The columns of the tensor list (its rows: _tensor_rows)."""
    # In a folder, name each tensor's file relative to it; for one file, no file column.
    in_folder = result.format == "folder"
    table = Table(title="Tensors", title_justify="left")
    columns = ["name", "dtype", "shape", "bytes"] + (["file"] if in_folder else [])
    for column in columns:
        table.add_column(column, justify="right" if column == "bytes" else "left")
    return table


def _tensor_rows(result: Report) -> Iterator[list[str]]:
    """Each tensor's cells, as shown (text()); shapes and files are few, each shown once."""
    in_folder = result.format == "folder"
    shapes: dict[tuple[int, ...], str] = {}
    files: dict[str, str] = {}
    for tensor in result.tensors:
        shape = shapes.get(tensor.shape)
        if shape is None:
            shape = shapes[tensor.shape] = shown(str(list(tensor.shape)))
        cells = [shown(tensor.name), shown(tensor.dtype), shape, f"{tensor.nbytes:,}"]
        if in_folder:
            file = files.get(tensor.file)
            if file is None:
                file = files[tensor.file] = shown(os.path.relpath(tensor.file, result.path))
            cells.append(file)
        yield cells


def _verdict(result: Report, fail_on: str) -> Text:
    counts = {severity: result.count(severity) for severity in Severity}
    verdict = Text()
    verdict.append(
        f"\n{counts[Severity.ERROR]} error(s), {counts[Severity.WARNING]} warning(s), "
        f"{counts[Severity.INFO]} info",
        style="bold",
    )
    verdict.append(f" → exit {result.exit_code(fail_on)} (--fail-on {fail_on})")
    if not result.findings:
        verdict.append("  clean", style="green")
    else:
        verdict.append_text(text(f"; {repair_clause(result)}"))
    return verdict


def repair_clause(result: Report) -> str:
    """How many findings `ckptfix fix PATH` would repair, or what stops it (a pipeline's
    components are repaired one at a time)."""
    command = (
        "`ckptfix fix` on its components"
        if result.format == "diffusers-pipeline"
        else (f"`ckptfix fix {result.path}`")
    )
    found = [code for code in result.fix_refused if result.count_code(code)]
    if found:
        return f"{command} repairs none until {', '.join(found)} is resolved"
    if result.fix_refused:  # not a finding: a checkpoint fix does not rewrite (torch, DCP)
        return f"{command} repairs none: it rewrites safetensors checkpoints only"
    return f"{command} would repair {result.repairable}"


def _heading(console: Console, title: str) -> None:
    """`title ────`: a terminal's width, 80 columns when piped (whose console is as wide as
    the longest line needs, so a rule would be a million columns long)."""
    width = console.width if console.is_terminal else _HEADING_WIDTH
    title = shown(title)
    console.print(text(f"{title} " + "─" * max(3, width - len(title) - 1)), soft_wrap=True)


def reports(results: list[Report], *, show_tensors: bool, fail_on: str) -> None:
    """Several reports in turn, each under a heading, then the combined verdict."""
    results = [result.with_fixes() for result in results]
    console = _console()
    for number, result in enumerate(results, start=1):
        if number > 1:
            console.print()
        _heading(console, f"{result.path} ({number} of {len(results)})")
        report(result, show_tensors=show_tensors, fail_on=fail_on)
    counts = {severity: sum(r.count(severity) for r in results) for severity in Severity}
    code = max(result.exit_code(fail_on) for result in results)
    verdict = Text()
    verdict.append(
        f"\n{len(results)} paths: {counts[Severity.ERROR]} error(s), "
        f"{counts[Severity.WARNING]} warning(s), {counts[Severity.INFO]} info",
        style="bold",
    )
    verdict.append(f" → exit {code} (--fail-on {fail_on})")
    if any(result.findings for result in results):
        verdict.append(f"; `ckptfix fix` would repair {sum(r.repairable for r in results)}")
    console.print(verdict)


def rewrite(result: RewriteResult) -> None:
    """The plan as a table, then what was written (or that nothing was, for --dry-run)."""
    console = _console()
    plan = result.plan
    print_table(console, _plan_table(plan), partial(_plan_rows, plan))
    for line in _plan_notes(plan) + _names_notes(plan) + _files_notes(plan):
        console.print(line)
    note = weights_note(result.report.layout)
    if note is not None:
        console.print(text(note, style="yellow"), soft_wrap=True)
    if result.written is None:
        where = f" to {result.destination}" if result.destination else ""
        console.print(text(f"dry run: nothing was written{where}", style="bold"))
        return
    for line in _written_notes(result.written):
        console.print(line, soft_wrap=True)
    if result.commit is not None:
        console.print(_commit_note(result.commit), soft_wrap=True)


def _commit_note(check: CommitCheck) -> Text:
    how = (
        f"every shard read back and its SHA-256 compared ({check.bytes_read:,} bytes, "
        f"{format_size(check.bytes_read)} read)"
        if check.by != "store checksum"
        else "every shard's size and checksum compared as the store reports them (nothing read)"
    )
    return text(f"commit: {check.parts} part(s), {check.shards} shard(s) checked: {how}")


def _plan_table(plan: ShardPlan) -> Table:
    table = Table(title=f"Plan: shards of at most {plan.max_shard:,} bytes", title_justify="left")
    for column, justify in (
        ("file", "left"),
        ("tensors", "right"),
        ("bytes", "right"),
        ("first tensor", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    return table


def _plan_rows(plan: ShardPlan) -> Iterator[list[str]]:
    for shard in plan.shards:
        first = shard.tensors[0] if shard.tensors else "-"
        yield [shown(shard.file), f"{len(shard.tensors):,}", f"{shard.nbytes:,}", shown(first)]


def _plan_notes(plan: ShardPlan) -> list[Text]:
    lines = []
    if plan.index_file:
        lines.append(text(f"index: {plan.index_file} (total_size {plan.total_size:,})"))
    if plan.metadata_scope != "every shard":
        lines.append(
            text(f"header metadata: over 64 KiB, so written in the {plan.metadata_scope} only")
        )
    lines += [
        text(
            f"! oversized-tensor: {name} is larger than the limit; it has a shard of its own",
            style="yellow",
        )
        for name in plan.oversized
    ]
    return lines


def _listed(names: Sequence[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _names_notes(plan: ShardPlan) -> list[Text]:
    lines = []
    if plan.dropped:
        pairs = [f"{d} → {k}" for d, k in plan.dropped.items()]
        lines.append(text(f"dropped (stored once, as the kept name): {_listed(pairs)}"))
        lines.append(
            text(
                f"{len(plan.dropped)} name(s) dropped: {format_size(plan.dropped_bytes)} not "
                "written again"
            )
        )
    if plan.shared:
        pairs = [f"{alias} → {kept}" for alias, kept in plan.shared.items()]
        lines.append(
            text(f"shared storage (stored once, loaded as tied tensors): {_listed(pairs)}")
        )
    if plan.kept_equal:
        groups = [" = ".join(group) for group in plan.kept_equal]
        lines.append(
            text(f"kept (equal bytes, not a declared tie; a loader needs each): {_listed(groups)}")
        )
    for edit in plan.config_edits:
        lines.append(text(f"{edit.file}: {edit.key} {edit.old} → {edit.new} (set for the cast)"))
    if plan.renamed:
        old_name, new_name = next(iter(plan.renamed.items()))
        lines.append(text(f"renamed {len(plan.renamed)} tensor(s), e.g. {old_name} → {new_name}"))
    if plan.excluded:
        names = ", ".join(plan.excluded[:6]) + (" ..." if len(plan.excluded) > 6 else "")
        lines.append(text(f"excluded {len(plan.excluded)} tensor(s): {names}"))
    return lines


def _files_notes(plan: ShardPlan) -> list[Text]:
    lines = []
    if plan.copied_files:
        lines.append(text("copied: " + ", ".join(plan.copied_files)))
    reasons: dict[str, list[str]] = {}
    for name in plan.left_out:
        reason = plan.left_out_reasons.get(name, "other weight file")
        reasons.setdefault(_LEFT_OUT.get(reason, reason), []).append(name)
    for reason, names in reasons.items():
        lines.append(text(f"left out ({reason}): " + ", ".join(names), style="yellow"))
    return lines


def _written_notes(written: WriteResult) -> list[Text]:
    checked = (
        "not verified (--no-verify)"
        if not written.verified
        else "every object checked against what was sent"
        if written.upload is not None
        else "every tensor verified against its source"
    )
    lines = [
        text(
            f"wrote {written.path}: {len(written.files)} file(s), {written.bytes:,} bytes "
            f"({format_size(written.bytes)}), {checked}",
            style="green",
        )
    ]
    lines += _zero_copy_notes(written)
    if written.upload is not None:
        from ckptfix.cli.render_upload import upload_notes

        return lines + upload_notes(written, written.upload)
    if written.replaced:
        old = [os.path.relpath(path, written.path) for path in written.replaced]
        shown = ", ".join(old) if len(old) <= 3 else f"{', '.join(old[:2])} and {len(old) - 2} more"
        lines.append(
            text(
                f"replaced: {written.path} (old contents: {shown}, moved aside and deleted)",
                style="yellow",
            )
        )
    return lines


def _zero_copy_notes(written: WriteResult) -> list[Text]:
    """Where the output's filesystem clones: what was shared, and how it was verified."""
    account = written.account
    if account is None or account.block is None:
        return []  # no reflinks between source and output: copied and compared, as always
    lines = [
        text(
            f"zero-copy: {format_size(account.cloned)} shared with the source "
            f"({account.block:,}-byte blocks), {format_size(account.copied)} copied, "
            f"{account.padding:,} bytes of header padding"
        )
    ]
    if written.verified:
        ways = account.verified_by
        parts = [
            f"{format_size(ways.get('extents', 0))} by identical extents",
            f"{format_size(ways.get('compared', 0))} compared byte for byte",
        ]
        if ways.get("digest"):
            parts.append(f"{format_size(ways['digest'])} by digest (cast or gathered)")
        lines.append(text("verified: " + ", ".join(parts)))
    return lines


@contextlib.contextmanager
def byte_progress(description: str = "writing") -> Iterator[Callable[[int, int], None]]:
    """A bytes / rate / ETA progress bar on stderr; yields the function that advances it."""
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update
