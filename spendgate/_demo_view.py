"""What the demo keeps and shows: its tally of budget keys and the live table (the PNG chart:
:mod:`spendgate._demo_chart`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Group
from rich.table import Table
from rich.text import Text

from spendgate._cli_tables import BudgetKey

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

#: What every demo run must show: a refusal carrying Retry-After, each enforcement action
#: of the hooli showcase, and alerts (thresholds and the overage) read back from Kafka.
SHOWCASED = (
    "refusal with Retry-After",
    "burst",
    "route",
    "stream stopped by a refused extend",
    "overage",
    "delay",
    "alerts",
)


@dataclass
class KeyView:
    """What the demo has seen of one budget key."""

    limit: int = 0
    used: int = 0
    reserved: int = 0
    unit: str = ""
    window_s: int = 0
    #: (seconds since start, used + reserved) samples for the chart.
    points: list[tuple[float, int]] = field(default_factory=list)
    #: seconds since start of each refusal on this key.
    refusals: list[float] = field(default_factory=list)


@dataclass
class Tally:
    """Running totals shown in the live table."""

    admitted: int = 0
    refused: int = 0
    committed: int = 0
    cancelled: int = 0
    late_reports: int = 0
    errors: int = 0
    last_retry: dict[str, str] = field(default_factory=dict)
    keys: dict[str, KeyView] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    #: (seconds since start, text) of late reports, marked on the chart.
    late: list[tuple[float, str]] = field(default_factory=list)
    #: What the enforcement-action showcase saw (printed again at the end).
    actions: list[str] = field(default_factory=list)
    #: Which of :data:`SHOWCASED` the run showed (the demo fails on any missing).
    shown: set[str] = field(default_factory=set)
    #: Alerts read back from the alerts topic at the end, by kind.
    alerts: dict[str, int] = field(default_factory=dict)
    #: Why reading the alerts topic last failed, if it did.
    alerts_error: str = ""

    def missing(self) -> list[str]:
        """What the demo promises and this run did not show, in :data:`SHOWCASED` order."""
        return [name for name in SHOWCASED if name not in self.shown]


def screen(tally: Tally, elapsed_s: float) -> Group:
    """The live screen: the budget table, then the latest events."""
    return Group(key_table(tally, elapsed_s), *(Text.from_markup(line) for line in tally.log[-6:]))


def key_table(tally: Tally, elapsed_s: float) -> KeyTable:
    """One row per budget key seen: its fill bar, used+reserved / limit, unit and window,
    and the last Retry-After a refusal on it carried."""
    rows = []
    for key, view in sorted(tally.keys.items()):
        held = view.used + view.reserved
        filled = round(min(1.0, held / max(view.limit, 1)) * _BAR)
        window = f" in {view.window_s}s" if view.window_s else ""
        fill = f"[{'#' * filled}{'.' * (_BAR - filled)}] {held:,} / {view.limit:,} {view.unit}"
        rows.append((key, Text(fill + window), Text(tally.last_retry.get(key, "-"))))
    title = (
        f"spendgate demo - {elapsed_s:.0f}s: admitted {tally.admitted}, refused {tally.refused}, "
        f"committed {tally.committed}, cancelled {tally.cancelled}, "
        f"late reports {tally.late_reports}"
    )
    return KeyTable(title, rows)


#: The fill bar's width in characters.
_BAR = 10
#: What the other columns get at least before the key column takes the rest: two lines
#: of the fill cell for the demo's amounts, and "never" of a Retry-After.
_FILL_MIN = 24
_RETRY_MIN = 5
#: Three columns' borders and padding.
_CHROME = 10


class KeyTable:
    """The demo's budget table, laid out at the width it is printed at.

    The key column is given room first: a key whole when the width allows, else broken
    only after its own ``|`` separators, never narrower than its longest part (at 80
    columns the demo's longest keys take two lines); the other cells wrap at their spaces.
    Nothing is cut. rich's own layout shrinks the widest column first, which folded a key
    over five lines at 80 columns.
    """

    def __init__(self, title: str, rows: list[tuple[str, Text, Text]]) -> None:
        self.title = title
        self.rows = rows

    def table(self, width: int) -> Table:
        """The table for ``width`` columns."""
        keys = [BudgetKey(key) for key, _, _ in self.rows]
        longest = max((cell_len(k.key) for k in keys), default=0)
        part = max((cell_len(p) for k in keys for p in k.parts), default=0)
        others = _CHROME + max((f.cell_len for _, f, _ in self.rows), default=0)
        others += max(_RETRY_MIN, *(r.cell_len for _, _, r in self.rows))
        if longest + others <= width:
            key_width = longest  # every key whole, every other cell on one line
        else:
            # Broken at its separators, a key needs its longest part; the other cells get
            # what they need on one line if that leaves it, and two lines' worth at least.
            key_width = min(max(part, width - others), width - _CHROME - _FILL_MIN - _RETRY_MIN)
        table = Table(title=self.title)
        table.add_column("budget key", width=max(key_width, len("budget key")))
        table.add_column("used+reserved / limit", overflow="fold")
        table.add_column("retry", overflow="fold")
        for key, (_, fill, retry) in zip(keys, self.rows, strict=True):
            table.add_row(key, fill, retry)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)


def observe(tally: Tally, budgets: list[dict[str, Any]], at: float) -> None:
    """Record the ``budgets`` of an answer (as the API returns them) seen ``at`` seconds in."""
    for b in budgets:
        view = tally.keys.setdefault(b["key"], KeyView())
        view.limit, view.used, view.reserved, view.unit = (
            b["limit"],
            b["used"],
            b["reserved"],
            b["unit"],
        )
        view.window_s = int(b.get("window_seconds", 0))
        view.points.append((at, b["used"] + b["reserved"]))


class Clock:
    """Seconds since the demo started (monotonic)."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.start
