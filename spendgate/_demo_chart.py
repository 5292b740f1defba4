"""The demo's PNG chart: one panel per policy, its keys' used+reserved against the limit.

Every panel spans the whole run on one shared time axis (a key seen twice in a second no
longer gets an axis of 0.06 s), each title fits its panel (the policy, its unit, window
and limit; the keys are in the legend beside it), and the layout is matplotlib's
constrained one, which keeps titles, labels and legends clear of each other.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from spendgate._demo_view import KeyView, Tally

__all__ = ["chart_figure", "policy_of", "write_chart"]

#: Inches per policy panel, and of the figure's width (the legend takes the right third).
_PANEL_H = 2.4
_WIDTH = 12.0


def policy_of(key: str) -> str:
    """The policy id a budget key starts with (``policy|field=value|...``; an id has no
    ``|``, nor anything budget keys escape)."""
    return key.split("|", 1)[0]


def chart_figure(tally: Tally) -> Figure:
    """The chart as a matplotlib figure on an Agg canvas (no display needed).

    Panels are the policies seen with samples, sorted by id; in each, a step line per
    key, the limit dashed, refusals as crosses on the limit, late usage reports of a
    tenant the panel holds as cyan lines.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels: dict[str, list[tuple[str, KeyView]]] = {}
    for key, view in sorted(tally.keys.items()):
        if view.points:
            panels.setdefault(policy_of(key), []).append((key, view))
    fig = Figure(figsize=(_WIDTH, 1.2 + _PANEL_H * max(1, len(panels))), layout="constrained")
    # Its own Agg canvas: no pyplot (no global figure list to leak into), no display.
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(panels)), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (policy, keys) in zip(axes, sorted(panels.items()), strict=False):
        _panel(ax, tally, policy, keys)
    axes[-1].set_xlabel("seconds since the demo started", fontsize=8)
    axes[0].set_xlim(0, _end(tally))
    fig.suptitle(
        f"spendgate demo: {tally.admitted} admitted, {tally.refused} refused, "
        f"{tally.cancelled} cancelled, {tally.late_reports} late reports (cyan lines)",
        fontsize=11,
    )
    return fig


def _panel(ax: Axes, tally: Tally, policy: str, keys: list[tuple[str, KeyView]]) -> None:
    limit = max(view.limit for _, view in keys)
    top = limit
    for key, view in keys:
        xs, ys = zip(*sorted(view.points), strict=True)
        top = max(top, *ys)
        group = key[len(policy) + 1 :] or "(one counter)"
        (line,) = ax.step(xs, ys, where="post", linewidth=1.2, marker=".", markersize=3)
        line.set_label(group + (f" ({len(view.refusals)} refused)" if view.refusals else ""))
        if view.refusals:
            ax.plot(view.refusals, [view.limit] * len(view.refusals), "x", color=line.get_color())
    tenants = {part.removeprefix("tenant=") for key, _ in keys for part in key.split("|")[1:]
               if part.startswith("tenant=")}  # fmt: skip
    for at, what in tally.late:
        if what.split(":", 1)[0] in tenants:
            ax.axvline(at, color="tab:cyan", alpha=0.5, linewidth=1)
    unit, window = keys[0][1].unit, keys[0][1].window_s
    ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"limit {limit:,}")
    ax.set_title(f"{policy}: {unit} in {window}s windows", fontsize=9)
    ax.set_ylim(0, top * 1.15)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _end(tally: Tally) -> float:
    """The shared axis's end: the last instant anything was seen, rounded up to 5 s."""
    seen = [t for v in tally.keys.values() for t, _ in v.points]
    seen += [t for v in tally.keys.values() for t in v.refusals]
    seen += [t for t, _ in tally.late]
    return max(5.0, 5 * math.ceil(max(seen, default=0.0) / 5))


def write_chart(tally: Tally, path: Path) -> Path:
    """Write :func:`chart_figure` as a PNG at ``path`` (its folder made if missing)."""
    fig = chart_figure(tally)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
