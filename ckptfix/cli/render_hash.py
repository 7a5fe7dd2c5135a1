"""Human output of `hash` and `diff`: short, plain lines (digest first, as sha256sum prints
them, names escaped as it escapes them: core.text.checksum_name). Every piece of text goes in
through render.text()."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rich.text import Text

from ckptfix.cli.render import _console, remote_line, text
from ckptfix.core.sizes import format_size
from ckptfix.core.text import checksum_name
from ckptfix.ops.compare import ValueDiff
from ckptfix.ops.diff import DiffResult
from ckptfix.ops.hash import HashResult

LISTED = 20  # names shown per kind of difference; --json lists every one


def _count(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _short(digest: str) -> str:
    return f"{digest[:12]}…"


def hash_result(
    result: HashResult,
    *,
    show_tensors: bool,
    manifest: str | os.PathLike[str] | None,
    replaced: bool = False,
) -> None:
    console = _console()
    console.print(_checksum_line(result.digest, "", result.path), soft_wrap=True)
    details = f"{result.algorithm} of {_count(result.tensor_count, 'tensor')}, "
    details += format_size(result.total_bytes)
    if result.aliases:
        details += f"; {len(result.aliases)} name(s) from the ckptfix.dropped record"
    if manifest is not None:
        details += f"; manifest written to {os.fspath(manifest)}"
        if replaced:
            details += " (it replaced the file of that name)"
    console.print(text(details, style="dim"), soft_wrap=True)
    if result.weights_note is not None:
        console.print(text(result.weights_note, style="yellow"), soft_wrap=True)
    if show_tensors:
        for tensor in result.tensors:
            layout = f"{tensor.dtype} {list(tensor.shape)}  "
            console.print(_checksum_line(tensor.digest, layout, tensor.name), soft_wrap=True)
    if result.remote is not None:
        console.print(text(remote_line(result.remote), style="dim"))


def _checksum_line(digest: str, middle: str, name: str) -> Text:
    """`<digest>  <middle><name>`, the name escaped as sha256sum escapes a file name, and
    then, as sha256sum does, a `\\` before the line."""
    escaped, name = checksum_name(name)
    return text(("\\" if escaped else "") + f"{digest}  {middle}{name}")


def _name(name: str) -> str:
    """A tensor name in diff's lists: escaped as in hash's lines, always (no `\\` before the
    line), so every line is one name and every backslash in it an escape."""
    return checksum_name(name)[1]


def diff_result(result: DiffResult, *, fail_on: str) -> None:
    console = _console()
    for side, note in result.weights_notes.items():
        console.print(text(f"{side.upper()}: {note}", style="yellow"), soft_wrap=True)
    if result.identical:
        console.print(
            text(
                f"identical: {_count(result.compared, 'tensor')}, {format_size(result.compared_bytes)} "
                f"({result.algorithm} {_short(result.digest or '')})",
                style="green",
            )
        )
        return
    for line in _stripped(result) + _difference_lines(result):
        console.print(line, soft_wrap=True)
    console.print(text(_summary(result, fail_on), style="bold"), soft_wrap=True)


def _stripped(result: DiffResult) -> list[Text]:
    return [
        text(f"compared {side.upper()} without the prefix {''.join(prefixes)!r}", style="dim")
        for side, prefixes in result.stripped.items()
        if prefixes
    ]


def _difference_lines(result: DiffResult) -> list[Text]:
    lines = _section(f"only in A ({result.a})", [_name(name) for name in result.only_in_a])
    lines += _section(f"only in B ({result.b})", [_name(name) for name in result.only_in_b])
    lines += _section(
        "dtype/shape changed",
        [
            f"{_name(c.name)}: {c.a[0]} {list(c.a[1])} → {c.b[0]} {list(c.b[1])}"
            for c in result.layout_changed
        ],
    )
    lines += _section(
        "tensors with other bytes",
        [
            _name(c.name) + (f": {_values(c.values)}" if c.values else "")
            for c in result.bytes_changed
        ],
    )
    return lines


def _section(title: str, items: Sequence[str]) -> list[Text]:
    if not items:
        return []
    lines = [text(f"{title}: {len(items):,}", style="yellow")]
    lines += [text(f"  {item}") for item in items[:LISTED]]
    if len(items) > LISTED:
        lines.append(text(f"  … and {len(items) - LISTED:,} more (--json lists every one)"))
    return lines


def _values(values: ValueDiff) -> str:
    line = f"{values.differing:,} of {values.numel:,} elements differ"
    if values.max_abs is not None:
        line += f", max abs {values.max_abs:.6g}, max rel {values.max_rel:.6g}"
    if values.non_finite:
        line += f", {values.non_finite:,} with NaN or Inf on one side"
    return line


def _summary(result: DiffResult, fail_on: str) -> str:
    parts = [
        (len(result.only_in_a), "only in A"),
        (len(result.only_in_b), "only in B"),
        (len(result.layout_changed), "dtype/shape changed"),
        (len(result.bytes_changed), "with other bytes"),
    ]
    same = result.compared - len(result.layout_changed) - len(result.bytes_changed)
    found = ", ".join(f"{count:,} {what}" for count, what in parts if count)
    common = f"{same:,} of {result.compared:,} common tensors identical"
    if not result.compared and not any(result.stripped.values()):
        common = "no names in common (try --strip-prefix auto)"
    return f"different: {found}; {common} → exit {result.exit_code(fail_on)} (--fail-on {fail_on})"
