"""Long tables (`inspect --tensors`, a rewrite's plan) are printed byte for byte as rich
prints them whole, without building them in rich (cli/render_table.py)."""

from __future__ import annotations

import gc
import io
import os
import re
import signal
from collections.abc import Callable, Sequence
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptfix.cli.render_table import BATCH, print_table
from ckptfix.core.text import shown
from tests.builders import Factory, Spec
from tests.helpers import cli

EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 3, 30)
# Cells as names come: plain, with spaces (rich wraps at them), wide (CJK, emoji: two
# columns each), combining marks (none), escapes, and long words rich cuts with an ellipsis.
CELLS = st.one_of(
    st.text(alphabet="abcdefghij._0123", max_size=30),
    st.text(alphabet="ab 宽字😀é\u0301.", max_size=20),
    st.text(max_size=12).map(shown),
    st.sampled_from(["", " ", "a  b", " lead", "trail ", "x" * 90]),
)
JUSTIFY = ("left", "left", "left", "right", "left")


def _console(width: int, terminal: bool, colour: str | None) -> Console:
    """A console as cli/render.py makes one: on a terminal, wrapping at its width (with
    colour or without); piped, as wide as any line."""
    plain = {"highlight": False, "markup": False, "emoji": False, "file": io.StringIO()}
    if terminal:
        return Console(force_terminal=True, width=width, color_system=colour, **plain)
    return Console(force_terminal=False, width=1_000_000, soft_wrap=True, **plain)


def _table(columns: int, title: str = "Tensors") -> Table:
    table = Table(title=title, title_justify="left")
    for index in range(columns):
        name = ("name", "dtype", "shape", "bytes", "file")[index]
        table.add_column(name, justify=JUSTIFY[index])  # type: ignore[arg-type]
    return table


def _both(
    rows: Sequence[Sequence[str]], console_of: Callable[[], Console], columns: int
) -> tuple[str, str]:
    """(rich's whole table, print_table's), on two consoles made alike."""
    whole, ours = console_of(), console_of()
    table = _table(columns)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    whole.print(table)
    print_table(ours, _table(columns), lambda: rows)
    return _text(whole), _text(ours)


def _text(console: Console) -> str:
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(
    rows=st.integers(4, 5).flatmap(
        lambda columns: st.lists(st.lists(CELLS, min_size=columns, max_size=columns), max_size=6)
    ),
    width=st.integers(12, 160),
    terminal=st.booleans(),
    colour=st.sampled_from([None, "standard", "truecolor"]),
)
def test_printed_as_rich_prints_the_whole_table(
    rows: list[list[str]], width: int, terminal: bool, colour: str | None
) -> None:
    columns = len(rows[0]) if rows else 4
    whole, ours = _both(rows, lambda: _console(width, terminal, colour), columns)
    assert ours == whole


@pytest.mark.slow
def test_rows_past_a_batch_and_rows_that_wrap() -> None:
    """More rows than one batch; on a narrow terminal, rows whose names wrap or are cut
    between rows that fit."""
    rows = [[f"model.layers.{i}.w", "F32", "[2, 2]", f"{16 * i:,}"] for i in range(BATCH + 7)]
    rows[5][0] = "a name with spaces that wraps over lines " * 2
    rows[9][0] = "x" * 200
    for terminal in (False, True):
        whole, ours = _both(rows, partial(_console, 60, terminal, "truecolor"), 4)
        assert ours == whole


@pytest.mark.slow
def test_a_long_table_holds_no_row_in_rich() -> None:
    """The objects alive while the rows are written do not grow with the rows: a row is
    formatted and written, never kept (rich holds every row until the last is laid out)."""
    live: list[int] = []

    class Sampling(io.StringIO):
        def write(self, text: str) -> int:
            live.append(len(gc.get_objects()))
            return super().write(text)

    rows = [[f"t.{i}", "U8", "[1]", "1"] for i in range(40_000)]
    console = Console(file=Sampling(), width=1_000_000, soft_wrap=True, highlight=False)
    print_table(console, _table(4), lambda: rows)
    assert len(live) >= 40_000 // BATCH  # written as it goes, a batch at a time
    assert max(live) - min(live) < 10_000  # not 40,000 rows' worth of objects


def _signal_at(monkeypatch: pytest.MonkeyPatch, target: object, name: str, call: int) -> None:
    """SIGTERM sent from test code (not ckptfix's, so the handler keeps it for a safe point,
    as it does in rich's code) at the `call`-th call of `target.name`."""
    real = getattr(target, name)
    calls = 0

    def wrapped(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)


@pytest.mark.slow
def test_a_signal_during_a_long_table_ends_the_command(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while `inspect --tensors` makes its table of 3 batches of rows: the command
    ends at the next batch with the usual exit code and error line (it used to be kept
    until rich had laid out the whole table, then lost: exit 0 after minutes for
    1,000,000 tensors)."""
    from ckptfix.cli import render

    count = 3 * BATCH
    specs = [Spec(f"t.{index}", "U8", (1,)) for index in range(count)]
    path = factory.safetensors("many.safetensors", specs)
    _signal_at(monkeypatch, render, "shown", 100)
    run = cli("inspect", path, "--tensors")
    assert (run.code, run.error_lines) == (
        128 + signal.SIGTERM,
        ["error: interrupted by SIGTERM (rule interrupted)"],
    )
    rows = [line for line in run.stdout.splitlines() if re.match(r"^│ t\.\d+ ", line)]
    assert len(rows) <= BATCH < count  # at most the batch written when the signal came


def test_a_signal_kept_for_a_safe_point_is_never_lost(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal kept while other code ran (here, the rendering of a short report) and no
    safe point reached after it still ends the command as interrupted, not as a success."""
    from ckptfix.cli import render

    path = factory.safetensors("one.safetensors")
    _signal_at(monkeypatch, render, "report", 1)
    run = cli("inspect", path)
    assert (run.code, run.error_lines) == (
        128 + signal.SIGTERM,
        ["error: interrupted by SIGTERM (rule interrupted)"],
    )
