"""Every finding code has one record (core.codes): its severity, meaning, help and repair,
from which CODES, FIXES, the SARIF rules are made and against which README's findings table is
checked (tests/test_docs.py). A code the source reports without a record fails here, before
a finding of it would fail at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ckptfix.core.codes import RECORDS
from ckptfix.core.findings import CODES
from ckptfix.core.fixes import FIXES, default_fix
from ckptfix.reports.rules import rule
from tests.source_trees import parsed

PACKAGE = Path(__file__).resolve().parent.parent / "ckptfix"


def reported_codes(source: str) -> set[str]:
    """The codes a module's source names as a finding's: the first argument of `finding(...)`
    and the `code = "..."` of its classes (the errors that report under their own code)."""
    codes = set()
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.Call) and node.args:
            callee = node.func
            name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", "")
            first = node.args[0]
            if name == "finding" and isinstance(first, ast.Constant):
                codes.add(str(first.value))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and [ast.unparse(target) for target in item.targets] == ["code"]
                    and isinstance(item.value, ast.Constant)
                ):
                    codes.add(str(item.value.value))
    return codes


@pytest.mark.slow
def test_every_code_the_source_reports_has_a_record() -> None:
    reported = {
        code: path.relative_to(PACKAGE)
        for path in sorted(PACKAGE.rglob("*.py"))
        for code in reported_codes(path.read_text())
    }
    assert len(reported) >= 30  # the scan finds the codes at all
    unrecorded = {code: str(path) for code, path in reported.items() if code not in RECORDS}
    assert not unrecorded, unrecorded


def test_the_code_scan_can_fail() -> None:
    source = (
        'finding("made-up", "m")\nchecks.finding("other-code", "m", file=f)\n'
        'finding(code, "m")\nclass E(Exception):\n    code = "own-code"\n    rule = "x"\n'
    )
    assert reported_codes(source) == {"made-up", "other-code", "own-code"}


def test_each_table_says_what_the_record_says() -> None:
    """The severity, the default fix and the SARIF rule of every code are its record's."""
    for code, record in RECORDS.items():
        assert CODES[code] is record.severity
        assert default_fix(code) == FIXES[code] == record.repair
        assert rule(code).help == record.help
        summary = record.summary.replace("`", "")
        assert rule(code).summary.rstrip(".").lower() == summary.rstrip(".").lower()
        assert record.repair.startswith(("ckptfix ", "none: ")), code
