"""The shape the architecture promises: no function over 60 lines, no module over 500, no
test module importing another (shared helpers live in builders, helpers and fixture
modules). (Complexity ≤ 10 and the argument count are ruff's: see pyproject.toml.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.source_trees import parsed

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


@pytest.mark.slow
def test_functions_are_at_most_60_lines() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(parsed(path.read_text())):
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
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [name for name in names if name.split(".")[:2][-1].startswith("test_")]
    return sorted({".".join(name.split(".")[:2]) for name in found if name.startswith("tests.")})


@pytest.mark.slow
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


# The layers of ARCHITECTURE.md, top to bottom: a module imports from its own layer and the
# layers below it, never from one above. Modules at the top of the package (`ckptfix`'s
# `__init__`, `__main__`, `precommit`) stand above them all.
LAYERS = (
    "cli",
    "reports",
    "api",
    "executors",
    "ops",
    "write",
    "plan",
    "checks",
    "mappings",
    "layouts",
    "formats",
    "io",
    "core",
    "platform",
)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """The lines of `if TYPE_CHECKING:` blocks: names for annotations, not imported at run time."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imported_layers(source: str) -> list[tuple[int, str]]:
    """(line, layer) of every `ckptfix.<layer>` a module's source imports at run time, the
    imports inside functions included."""
    tree = parsed(source)
    typing_only = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", 0) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ckptfix":
                names = [f"ckptfix.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "ckptfix" and len(parts) > 1 and parts[1] in LAYERS:
                found.append((node.lineno, parts[1]))
    return found


def upward_imports(layer: str, source: str) -> list[tuple[int, str]]:
    """The imports of a module of `layer` from a layer above it."""
    rank = LAYERS.index(layer)
    return [(line, to) for line, to in imported_layers(source) if LAYERS.index(to) < rank]


@pytest.mark.slow
def test_no_layer_imports_one_above_it() -> None:
    upward = []
    for path in _modules():
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) < 2:
            continue  # the package's top: above every layer
        assert relative.parts[0] in LAYERS, f"{relative}: a folder ARCHITECTURE.md does not place"
        for line, to in upward_imports(relative.parts[0], path.read_text()):
            upward.append(f"{relative}:{line} imports ckptfix.{to}")
    assert not upward, upward


def test_the_layer_check_can_fail() -> None:
    source = (
        "from ckptfix.ops.load import load\n"
        "from ckptfix import write\n"
        "from ckptfix.core.tensor import TensorInfo\n"
        "def f():\n    import ckptfix.cli.app\n"
        "if TYPE_CHECKING:\n    from ckptfix.ops.report import Report\n"
    )
    assert upward_imports("plan", source) == [(1, "ops"), (2, "write"), (5, "cli")]
    assert upward_imports("core", "from ckptfix.formats.base import FileRead\n") == [(1, "formats")]
    assert upward_imports("ops", source) == [(5, "cli")]


def written_twice(sources: dict[str, str], least: int = 3) -> list[list[str]]:
    """Functions of `least` statements or more (its docstring aside) whose parameters and body
    are the same, to the names, in two places: code written twice, to be written once. (Their
    lines compared as text, as ruff formats them, without comments.)"""
    places: dict[str, list[str]] = {}
    for where, source in sources.items():
        lines = source.splitlines()
        for node in ast.walk(parsed(source)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if not body or sum(isinstance(n, ast.stmt) for s in body for n in ast.walk(s)) < least:
                continue
            text = [line.strip() for line in lines[body[0].lineno - 1 : node.end_lineno]]
            shape = ast.dump(node.args) + "\n".join(t for t in text if not t.startswith("#"))
            places.setdefault(shape, []).append(f"{where}:{node.lineno} {node.name}")
    return [found for found in places.values() if len(found) > 1]


@pytest.mark.slow
def test_no_function_is_written_twice() -> None:
    sources = {str(path.relative_to(PACKAGE)): path.read_text() for path in _modules()}
    assert written_twice(sources) == []


def test_the_twice_check_can_fail() -> None:
    body = "    if fd >= 0:\n        os.close(fd)\n    return -1\n"
    sources = {"a.py": f"def closed(fd):\n{body}", "b.py": f"class B:\n  def release(fd):\n{body}"}
    assert written_twice(sources) == [["a.py:1 closed", "b.py:2 release"]]
    assert (
        written_twice({"a.py": "def f(x):\n    return x\n", "b.py": "def g(x):\n    return x\n"})
        == []
    )
