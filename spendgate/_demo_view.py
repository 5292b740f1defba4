"""What the demo keeps and shows: its tally of budget keys, the live table, the PNG chart."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

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


def key_table(tally: Tally, elapsed_s: float) -> Table:
    """One row per budget key seen: its unit, fill bar, window and last Retry-After."""
    table = Table(
        title=f"spendgate demo - {elapsed_s:4.0f}s  admitted {tally.admitted}  "
        f"refused {tally.refused}  committed {tally.committed}  "
        f"cancelled {tally.cancelled}  late reports {tally.late_reports}"
    )
    # The key column folds (wraps mid-word) rather than cutting: a key has no spaces, and
    # which tenant is near its limit is the point of the table. Cells are Text, never markup.
    table.add_column("budget key", overflow="fold", ratio=3)
    for col in ("unit", "used+reserved / limit", "window", "last Retry-After"):
        table.add_column(col, overflow="fold")
    for key, view in sorted(tally.keys.items()):
        share = min(1.0, (view.used + view.reserved) / max(view.limit, 1))
        bar = "#" * int(share * 20) + "." * (20 - int(share * 20))
        table.add_row(
            Text(key),
            Text(view.unit),
            Text(f"[{bar}] {view.used + view.reserved}/{view.limit}"),
            f"{view.window_s}s" if view.window_s else "-",
            Text(tally.last_retry.get(key, "-")),
        )
    return table


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


def write_chart(tally: Tally, path: Path) -> Path:
    """A PNG: one panel per budget key, used+reserved against its limit, refusals marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(k for k, v in tally.keys.items() if v.points)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = 2 if len(keys) > 1 else 1
    rows = max(1, (len(keys) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys, strict=False):
        view = tally.keys[key]
        xs, ys = zip(*sorted(view.points), strict=True)
        ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.3, label="used + reserved")
        ax.axhline(view.limit, color="black", linestyle="--", linewidth=1, label="limit")
        if view.refusals:
            ax.plot(
                view.refusals,
                [view.limit] * len(view.refusals),
                "x",
                color="red",
                markersize=6,
                label=f"refused ({len(view.refusals)})",
            )
        tenant = key.split("tenant=")[1].split("|")[0] if "tenant=" in key else ""
        for at, _ in (t for t in tally.late if tenant and t[1].startswith(tenant + ":")):
            ax.axvline(at, color="tab:cyan", alpha=0.5, linewidth=1)
        ax.set_title(f"{key}  ({view.unit}, {view.window_s}s window)", fontsize=9)
        ax.set_ylim(0, max(view.limit, max(ys)) * 1.15)
        ax.set_xlabel("seconds since start", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"spendgate demo: {tally.admitted} admitted, {tally.refused} refused, "
        f"{tally.cancelled} cancelled, {tally.late_reports} late reports (cyan lines)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
