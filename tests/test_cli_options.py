"""The options the commands share are defined once (ckptfix/cli/options.py): no option is
declared twice with the same flags and help anywhere in the CLI. (An option that means
something else under the same flag, inspect's --json or hash's --manifest, says so in its own
help.)"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

CLI = Path(__file__).resolve().parent.parent / "ckptfix" / "cli"


def declared_options(source: str) -> list[tuple[str, ...]]:
    """(flags..., help) of every `typer.Option(...)` a module's source declares."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("typer.Option", "Option")
            and node.args
        ):
            flags = tuple(ast.unparse(arg) for arg in node.args)
            helps = [ast.unparse(k.value) for k in node.keywords if k.arg == "help"]
            found.append((*flags, *helps))
    return found


@pytest.mark.slow
def test_no_option_is_declared_twice() -> None:
    declared = Counter(
        option for path in sorted(CLI.glob("*.py")) for option in declared_options(path.read_text())
    )
    assert declared, "no typer.Option found at all"
    twice = [option for option, count in declared.items() if count > 1]
    assert not twice, twice


def test_the_declaration_scan_can_fail() -> None:
    source = (
        'A = Annotated[bool, typer.Option("--dry-run", help="Print the plan.")]\n'
        'def f(x: Annotated[bool, typer.Option("--dry-run", help="Print the plan.")]): ...\n'
    )
    assert Counter(declared_options(source)) == {("'--dry-run'", "'Print the plan.'"): 2}
