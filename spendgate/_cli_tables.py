"""Tables that cut nothing: across when every column's longest word fits, else one record
per row, its first cell on a line of its own and the other fields below it; and budget
keys that wrap only after their own ``|`` separators.

rich cuts a cell that does not fit with an ellipsis (``1234…``) by default; a budget key
or an amount cut so is wrong, not short. Here a cell only ever wraps at its spaces, and
when the columns' longest words do not fit side by side the rows go vertical: a demo
budget key (75 characters) then stands whole on an 80-column terminal, and an amount of
2**53-1 keeps all its digits.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.console import Group
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderableType, RenderResult

__all__ = ["BudgetKey", "FitTable"]

#: A width no table reaches: what its columns need when nothing has to give.
_UNBOUNDED = 1_000_000


class BudgetKey:
    """A budget key (``policy|field=value|...``) in a cell too narrow for it: it breaks
    after a ``|`` (the key's own separators: a value's ``|`` is escaped as ``%7C``), so
    each line is a whole ``field=value``; a part wider than the cell folds. Every
    character stays: the lines joined are the key."""

    def __init__(self, key: str, style: str = "") -> None:
        self.key = key
        self.style = style
        self.parts: list[str] = [p for p in _AFTER_BAR.findall(key) if p]

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((cell_len(p) for p in self.parts), default=0)
        return Measurement(widest, cell_len(self.key)).with_maximum(options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = [""]
        for part in self.parts:
            if lines[-1] and cell_len(lines[-1] + part) > options.max_width:
                lines.append(part)
            else:
                lines[-1] += part
        yield Text("\n".join(lines), style=self.style, overflow="fold")


_AFTER_BAR = re.compile(r"[^|]*\|?")


class FitTable:
    """A table of ``headers`` that fits the width it is printed at without cutting a cell.

    Cells are text: a ``str`` is read as console markup (``[green]running[/]``), so data
    (a policy match, a key) goes in as :class:`rich.text.Text`.
    """

    def __init__(self, *headers: str, title: str | None = None, caption: str | None = None):
        self.headers = headers
        self.title = title
        self.caption = caption
        self.rows: list[tuple[RenderableType, ...]] = []

    def add_row(self, *cells: RenderableType) -> None:
        """Add a row, one cell per header."""
        if len(cells) != len(self.headers):
            raise ValueError(f"{len(cells)} cells for {len(self.headers)} columns")
        self.rows.append(cells)

    def across(self) -> Table:
        """The rows side by side: every column folds rather than cuts."""
        table = Table(title=self.title, caption=self.caption)
        for header in self.headers:
            table.add_column(header, overflow="fold")
        for row in self.rows:
            table.add_row(*row)
        return table

    def down(self) -> Group:
        """One record per row: its first cell alone on a line, then ``header  value``
        lines indented below it, a blank line between records."""
        parts: list[RenderableType] = []
        if self.title:
            parts.append(Text(self.title, style="table.title"))
        for n, (first, *rest) in enumerate(self.rows):
            if n or self.title:
                parts.append(Text())
            parts.append(_bold(first))
            fields = Table.grid(padding=(0, 2))
            fields.add_column(style="table.header", no_wrap=True)
            fields.add_column(overflow="fold")
            for header, cell in zip(self.headers[1:], rest, strict=True):
                fields.add_row(header, cell)
            parts.append(Padding(fields, (0, 0, 0, 2), expand=False))
        if self.caption:
            parts.append(Text(self.caption, style="table.caption"))
        return Group(*parts)

    def fits_across(self, console: Console, options: ConsoleOptions) -> bool:
        """Whether the rows side by side fit ``options.max_width`` with no word broken."""
        wide = options.update_width(_UNBOUNDED)
        return Measurement.get(console, wide, self.across()).minimum <= options.max_width

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.across() if self.fits_across(console, options) else self.down()


def _bold(cell: RenderableType) -> RenderableType:
    if isinstance(cell, BudgetKey):
        # Alone on its line, the key wraps at the width like any text.
        return Text(cell.key, style="bold")
    if isinstance(cell, str):
        return Text.from_markup(cell, style="bold")
    if isinstance(cell, Text):
        bold = cell.copy()
        bold.stylize("bold")
        return bold
    return cell
