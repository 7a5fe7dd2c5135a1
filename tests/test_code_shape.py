"""The shape the architecture promises: no function over 60 lines, no module over 500.
(Complexity ≤ 10 and the argument count are ruff's: see pyproject.toml.)"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptfix"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_modules_are_at_most_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_functions_are_at_most_60_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 60:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = length
    assert not long, long


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The measuring itself: a 61-line function is seen as one."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    tree = ast.parse(f"def long():\n{body}\n")
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert (node.end_lineno or 0) - node.lineno + 1 == 61
