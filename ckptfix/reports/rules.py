"""What each finding code means and how to fix it, from its record (core.codes): the rule
texts of SARIF reports."""

from __future__ import annotations

from dataclasses import dataclass

from ckptfix.core.codes import RECORDS, Severity


@dataclass(frozen=True)
class Rule:
    code: str
    severity: Severity
    summary: str  # one sentence: when the finding is reported
    help: str  # how to fix it


def _sentence(summary: str) -> str:
    """README's words as a sentence: a capital, no Markdown quotes, a full stop."""
    plain = summary.replace("`", "")
    return plain[:1].upper() + plain[1:] + ("" if plain.endswith(".") else ".")


def rule(code: str) -> Rule:
    """The rule of a finding code; an unknown code gets a generic text rather than failing."""
    record = RECORDS.get(code)
    if record is None:
        return Rule(
            code, Severity.WARNING, f"ckptfix finding {code}.", "See the finding's message."
        )
    return Rule(code, record.severity, _sentence(record.summary), record.help)


def rules() -> list[Rule]:
    """Every rule, in the order of the records (core.codes)."""
    return [rule(code) for code in RECORDS]
