"""docs/api.md runs: its ```python blocks, in order, in an empty folder; and where a line's
comment gives a value (`expression  # value`), the expression has it."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from tests import docs_pages

API = docs_pages.page("api.md")


def api_blocks(text: str) -> list[str]:
    """The ```python blocks of a page: every one is runnable, and run."""
    return [
        "\n".join(block.lines) + "\n" for block in docs_pages.blocks(text) if block.info == "python"
    ]


def stated_value(comment: str) -> tuple[bool, object]:
    """The value a comment states (`# (2, None): why` -> (2, None)): the longest prefix, cut
    before a `: `, that is a Python literal without `...`; (False, None) when none is."""
    cuts = [len(comment), *(m.start() for m in re.finditer(r": ", comment))]
    for cut in sorted(cuts, reverse=True):
        try:
            value = ast.literal_eval(comment[:cut].strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if "..." not in comment[:cut]:
            return True, value
    return False, None


def with_checks(block: str) -> str:
    """The block with an assertion after each `expression  # value` line."""
    lines = []
    for line in block.splitlines():
        lines.append(line)
        code, _, comment = line.partition("  # ")
        if not comment or code.startswith((" ", "\t")) or "=" in code.split("(")[0]:
            continue
        stated, value = stated_value(comment)
        if stated and isinstance(ast.parse(code).body[0], ast.Expr):
            lines.append(f"assert ({code}) == {value!r}, ({code!r}, {code})")
    return "\n".join(lines)


def run_blocks(blocks: list[str], folder: Path) -> None:
    namespace: dict[str, object] = {"__name__": "api_docs"}
    previous = os.getcwd()
    os.chdir(folder)
    try:
        for number, block in enumerate(blocks, start=1):
            exec(
                compile(with_checks(block), f"docs/api.md Python block {number}", "exec"), namespace
            )
    finally:
        os.chdir(previous)


@pytest.mark.slow
def test_the_python_api_examples_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = api_blocks(API)
    assert len(blocks) == 5
    stated = [
        line
        for b in blocks
        for line in b.splitlines()
        if stated_value(line.partition("  # ")[2])[0]
    ]
    assert len(stated) >= 5  # values the examples state, and the run checks
    run_blocks(blocks, tmp_path)
    assert (tmp_path / "my-model" / "model.safetensors.index.json").is_file()


def test_the_checks_see_a_wrong_value(tmp_path: Path) -> None:
    assert stated_value("(2, None): what the CLI exits 2 for") == (True, (2, None))
    assert stated_value("{'a': 'b'}: recorded") == (True, {"a": "b"})
    assert stated_value("['x', ...]") == (False, None)
    assert stated_value("0 or 1, as the CLI would exit") == (False, None)
    run_blocks(["x = 1 + 1\nx  # 2"], tmp_path)
    with pytest.raises(AssertionError):
        run_blocks(["x = 1 + 1\nx  # 3"], tmp_path)
