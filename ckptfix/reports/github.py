"""GitHub Actions workflow commands: one `::error file=F,title=CODE::message` per finding.

The runner turns them into annotations; a `file=` relative to the checkout puts them on
that file in a pull request's diff. Each text is first shown as every printed line is
(core.text.shown: control characters escaped, `##[` made inert), then escaped as GitHub's
runner unescapes it: in data, `%`, CR and LF; in properties, also `:` and `,`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptfix.core.findings import Severity
from ckptfix.core.text import shown
from ckptfix.ops.report import Report
from ckptfix.reports.locations import Located, display_path, located

COMMANDS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(kind: str, message: str, *, title: str, file: str | None = None) -> str:
    """One workflow command line (no newline): `::KIND file=F,title=T::message`."""
    properties = [f"file={escape_property(shown(file))}"] if file is not None else []
    properties.append(f"title={escape_property(shown(title))}")
    return f"::{kind} {','.join(properties)}::{escape_data(shown(message))}"


def annotation(item: Located, root: str) -> str:
    """The workflow command of one finding. A finding without a file (a folder-level one)
    has no `file=`; its message then starts with the checked folder."""
    finding = item.finding
    if item.file is None:
        message = f"{display_path(item.checked, root)}: {finding.message}"
        return command(COMMANDS[finding.severity], message, title=finding.code)
    file = display_path(item.file, root)
    return command(COMMANDS[finding.severity], finding.message, title=finding.code, file=file)


def render(reports: Sequence[Report], *, root: str, fail_on: str = "error") -> bytes:
    """One workflow command per finding of every report (fail_on does not filter them)."""
    return "".join(annotation(item, root) + "\n" for item in located(reports)).encode()
