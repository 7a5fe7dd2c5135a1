"""The shape the architecture promises: no function over 60 lines, no module over 500, no
test module importing another (shared helpers live in builders, helpers and fixture
modules). (Complexity ≤ 10 and the argument count are ruff's: see pyproject.toml.)"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ckptfix"
TESTS = Path(__file__).resolve().parent


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


def imported_test_modules(source: str) -> list[str]:
    """The test modules (`tests.test_*`) a module's source imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [name for name in names if name.split(".")[:2][-1].startswith("test_")]
    return sorted({".".join(name.split(".")[:2]) for name in found if name.startswith("tests.")})


def test_no_test_module_imports_another() -> None:
    importing = {
        path.name: modules
        for path in sorted(TESTS.glob("*.py"))
        if (modules := imported_test_modules(path.read_text()))
    }
    assert not importing, importing


def test_the_import_check_can_fail() -> None:
    assert imported_test_modules("from tests.test_a import f\nimport tests.test_b") == [
        "tests.test_a",
        "tests.test_b",
    ]
    assert imported_test_modules("from tests import test_c, helpers") == ["tests.test_c"]
    assert imported_test_modules("from tests.helpers import cli\nimport test_x") == []
