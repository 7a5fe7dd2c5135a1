"""Tables of any length, printed as rich prints them, without building them in rich.

rich renders a Table whole: a cell object, its measurement and its segments for every row,
all held until the last row is laid out (3 GB and minutes for 1,000,000 tensors), and the
collector walking those millions of objects for seconds at a time, during which no signal
handler runs (a SIGTERM went unanswered). Here rich renders only a table of the header and
the widest cells, which fixes the column widths as the whole table would (a column is as
wide as its widest cell, or as its longest word where the console is too narrow); its
head and bottom lines are printed as rendered, and each row is written out directly, a batch
of lines at a time, or, when a cell does not fit its column (wrapped or cut short), rendered
by rich alone at those widths. The output is byte for byte what rich prints
(tests/test_render_table.py compares them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rich.box import Box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptfix.core.signals import current as current_signals

Rows = Callable[[], Iterable[Sequence[str]]]  # the cells, as shown; called twice
BATCH = 4096  # lines written at a time (a safe point for signals between batches)


@dataclass(frozen=True)
class Layout:
    """What the table of the widest cells told: the lines before the first row and after
    the last, each column's width (padding included), and the row's box characters."""

    head: list[str]
    bottom: str
    widths: list[int]
    box: Box


def print_table(console: Console, table: Table, rows: Rows) -> None:
    """Print `table` (its columns set, no rows) with `rows` as rich would print it whole."""
    widest = _widest_cells(len(table.columns), rows())
    if widest is None:
        console.print(table)
        return
    layout = _layout(console, table, widest)
    if layout is None:  # a box or console this does not model: rich itself, whole
        for row in rows():
            table.add_row(*(Text(cell) for cell in row))
        console.print(table)
        return
    justify = [column.justify for column in table.columns]
    lines = list(layout.head)
    for row in rows():
        lines += _row_lines(console, table, layout, justify, row)
        if len(lines) >= BATCH:
            _write(console, lines)
            lines = []
    lines.append(layout.bottom)
    _write(console, lines)


def _width(cell: str) -> int:
    return len(cell) if cell.isascii() else cell_len(cell)


def _longest_word(cell: str) -> int:
    """rich's minimum width of a cell: its longest run without white space."""
    if cell.isascii() and " " not in cell:
        return len(cell)
    return max((cell_len(word) for word in cell.split()), default=_width(cell))


def _widest_cells(count: int, rows: Iterable[Sequence[str]]) -> list[list[str]] | None:
    """Two rows: each column's widest cell, and its cell with the longest word (None when
    there are no rows). A column's width depends on nothing else."""
    widest = [""] * count
    wordiest = [""] * count
    sizes = [-1] * count
    words = [-1] * count
    seen = False
    for row in rows:
        seen = True
        for index, cell in enumerate(row):
            size = _width(cell)
            if size > sizes[index]:
                sizes[index], widest[index] = size, cell
            if size > words[index]:  # a word is never longer than its cell
                word = _longest_word(cell)
                if word > words[index]:
                    words[index], wordiest[index] = word, cell
    return [widest, wordiest] if seen else None


def _rendered(console: Console, table: Table, rows: Iterable[Sequence[str]]) -> list[str]:
    """The table with `rows` as rich prints it on this console, line by line."""
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    with console.capture() as capture:
        console.print(table)
    return capture.get().split("\n")[:-1]


def _copy(table: Table, widths: Sequence[int] | None = None) -> Table:
    """An empty table like `table`; with `widths`, its columns fixed at them."""
    copy = Table(title=table.title, title_justify=table.title_justify, box=table.box)
    for index, column in enumerate(table.columns):
        width = None if widths is None else widths[index] - 2  # less the padding
        copy.add_column(column.header, justify=column.justify, width=width)
    return copy


def _layout(console: Console, table: Table, widest: list[list[str]]) -> Layout | None:
    if table.box is None or not table.show_edge or not table.show_header:
        return None
    box = table.box.substitute(console.options, safe=console.safe_box)  # as Table._render
    lines = _rendered(console, _copy(table), widest)
    if not lines:
        return None
    bottom = lines[-1]
    parts = bottom[1:-1].split(box.bottom_divider) if len(bottom) > 1 else []
    widths = [len(part) for part in parts]
    separator = box.get_row(widths, "head", edge=True)
    if not widths or box.get_bottom(widths) != bottom or separator not in lines:
        return None
    head = lines[: lines.index(separator) + 1]
    return Layout(head, bottom, widths, box)


def _row_lines(
    console: Console, table: Table, layout: Layout, justify: Sequence[str], row: Sequence[str]
) -> list[str]:
    """The lines of one row: written directly when every cell fits its column, else as
    rich renders that row at the table's widths (wrapped, or cut short with an ellipsis)."""
    box = layout.box
    parts = []
    for cell, width, how in zip(row, layout.widths, justify, strict=True):
        if how == "right":
            cell = cell.rstrip()  # as rich justifies to the right
        gap = width - 2 - _width(cell)
        if gap < 0:
            lines = _rendered(console, _copy(table, layout.widths), [row])
            return lines[len(layout.head) : -1]
        parts.append(f" {' ' * gap}{cell} " if how == "right" else f" {cell}{' ' * gap} ")
    return [box.mid_left + box.mid_vertical.join(parts) + box.mid_right]


def _write(console: Console, lines: list[str]) -> None:
    """Lines straight to the console's file, as rich writes what it rendered; between two
    batches, a signal kept meanwhile stops the command (core.signals)."""
    console.file.write("\n".join(lines) + "\n")
    signals = current_signals()
    if signals is not None:
        signals.raise_deferred()
