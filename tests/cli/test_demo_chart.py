"""The demo's chart: one panel per policy on one shared time axis spanning the run, and no
title over another title or another panel (what the one-panel-per-key chart did)."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import combinations
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from spendgate._demo_chart import chart_figure, policy_of, write_chart
from tests.fixtures.wide import demo_budget_keys, demo_tally


@pytest.fixture(scope="module")
def figure() -> Iterator[Figure]:
    fig = chart_figure(demo_tally(seconds=40.0))
    fig.canvas.draw()
    yield fig


def _titles(fig: Figure) -> list[Text]:
    """The figure's title and every panel's, as drawn."""
    shown = {fig.get_suptitle(), *(ax.get_title() for ax in fig.axes)} - {""}
    return [t for t in fig.findobj(Text) if isinstance(t, Text) and t.get_text() in shown]


def _box(text: Text, fig: Figure) -> Bbox:
    return text.get_window_extent(fig.canvas.get_renderer())  # type: ignore[attr-defined]


class TestPanels:
    def test_one_panel_per_policy(self, figure: Figure) -> None:
        policies = sorted({policy_of(k) for k in demo_budget_keys()})
        assert [ax.get_title().split(":")[0] for ax in figure.axes] == policies

    def test_every_panel_spans_the_run_on_one_axis(self, figure: Figure) -> None:
        limits = {ax.get_xlim() for ax in figure.axes}
        assert len(limits) == 1, limits
        ((start, end),) = limits
        # The hooli keys were seen 0.06 s apart: their panels still span the 40 s run.
        assert start == 0 and 40 <= end <= 45


class TestTitles:
    def test_no_title_overlaps_another(self, figure: Figure) -> None:
        titles = _titles(figure)
        assert len(titles) == len(figure.axes) + 1
        for a, b in combinations(titles, 2):
            assert not _box(a, figure).overlaps(_box(b, figure)), (a.get_text(), b.get_text())

    def test_no_title_overlaps_another_panel_or_leaves_the_figure(self, figure: Figure) -> None:
        for ax in figure.axes:
            title = next(t for t in _titles(figure) if t.get_text() == ax.get_title())
            box = _box(title, figure)
            assert figure.bbox.contains(box.x0, box.y0) and figure.bbox.contains(box.x1, box.y1)
            for other in figure.axes:
                if other is not ax:
                    assert not box.overlaps(other.get_window_extent()), ax.get_title()


def test_the_png_is_written(tmp_path: Path) -> None:
    written = write_chart(demo_tally(seconds=36.0), tmp_path / "out" / "demo-usage.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
