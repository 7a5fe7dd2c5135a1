"""Findings: what inspect reports, with one fixed severity per code (core.codes;
docs/findings.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ckptfix.core.codes import RECORDS
from ckptfix.core.codes import Severity as Severity  # where every module imports it from

# One severity per code, from its record (core.codes).
CODES: dict[str, Severity] = {code: record.severity for code, record in RECORDS.items()}


@dataclass(frozen=True)
class Finding:
    """One problem: a code, its severity, the file and tensors involved, a one-line message."""

    code: str
    severity: Severity
    message: str
    file: str | None = None
    tensors: tuple[str, ...] = field(default=())
    # How to repair it: the command that does, or why none can (core.fixes; set for the
    # checkpoint at hand by plan.repair_verdicts when a report is shown: Report.with_fixes).
    fix: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, object]:
        from ckptfix.core.fixes import default_fix

        return {
            "code": self.code,
            "severity": self.severity.value,
            "file": self.file,
            "tensors": list(self.tensors),
            "message": self.message,
            "fix": default_fix(self.code, preset=self.fix),
        }


def finding(
    code: str,
    message: str,
    *,
    file: str | None = None,
    tensors: Iterable[str] = (),
    fix: str | None = None,
) -> Finding:
    """Build a finding; the severity comes from the code so it can never drift. `fix`: how
    to repair this one, when it is not what every finding of its code says (core.fixes; SRC
    stands for the checkpoint's path)."""
    return Finding(code, CODES[code], message, file, tuple(tensors), fix)


def name_list(names: list[str] | tuple[str, ...], limit: int = 3) -> str:
    """`'a', 'b', 'c' and 4 more` for messages that must stay on one line."""
    shown = ", ".join(repr(name) for name in names[:limit])
    extra = len(names) - limit
    return f"{shown} and {extra} more" if extra > 0 else shown


def split_message(message: str) -> tuple[str, str | None, str | None]:
    """A finding's message, `<what> (rule <rule>; <fix>)` or `<what> (<fix>)`, as (what,
    rule, fix): its last parenthesised group, when it ends the message, is the fix."""
    if not message.endswith(")"):
        return message, None, None
    depth = 0
    for index in range(len(message) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(message[index], 0)
        if depth == 0:
            break
    if depth or index == 0 or message[index - 1] != " ":
        return message, None, None
    what, inner = message[: index - 1], message[index + 1 : -1]
    if inner.startswith("rule "):
        rule, _, fix = inner[len("rule ") :].partition("; ")
        return what, rule, fix or None
    return what, None, inner


def error_line(item: Finding) -> str:
    """A finding as a stderr line naming its rule: `error: <file>: <what> (rule <rule>; <fix>)`."""
    what, rule, fix = split_message(item.message)
    where = f"{item.file}: " if item.file else ""
    return f"error: {where}{what} (rule {rule or item.code}{f'; {fix}' if fix else ''})"
