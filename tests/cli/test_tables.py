"""Every table the CLI prints, at 80 columns, with the demo's longest budget keys and amounts
of 2**53-1: every character of every key and number comes back (whitespace and wrapping
aside), nothing is cut with an ellipsis, no line is wider than 80. Progress bars only on a
terminal."""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from spendgate._cli_output import Decidability, Readiness, progress
from spendgate._demo_view import KeyView, Tally, key_table
from spendgate.cli import app
from spendgate.devcluster import LocalCluster, NodeStatus
from spendgate.devstack import LocalStack, ServiceStatus
from spendgate.schemas.status import PartitionStatus, StackStatus, TopologyCounts, WorkerLag
from tests.fixtures.wide import (
    BIG,
    big_alert,
    big_policies,
    big_report,
    big_rows,
    longest_demo_keys,
)

KEYS = longest_demo_keys()
#: A log path as long as a deep home folder makes it.
LOG = Path("/home/a-rather-long-user-name/.local/state/spendgate/stack/logs/kafka-broker.log")


def _columns(text: str) -> list[str]:
    """Each column's text top to bottom, whitespace removed: a cell wrapped or folded over
    lines reads whole again. Lines outside a box are one column of their own."""
    columns: dict[int, str] = {}
    for line in text.splitlines():
        for n, piece in enumerate(re.split("[│┃]", line)):
            columns[n] = columns.get(n, "") + "".join(piece.split())
    return list(columns.values())


def missing(text: str, *values: str) -> list[str]:
    """The ``values`` (keys, numbers) not found whole in one column of ``text``; thousands
    separators aside, as a number may be printed with them."""
    columns = _columns(text)
    bare = {v: "".join(v.split()) for v in values}
    return [
        v
        for v, b in bare.items()
        if not any(b in c or b.replace(",", "") in c.replace(",", "") for c in columns)
    ]


def assert_whole(text: str, *values: str) -> None:
    assert "…" not in text, text
    # Tables fit; a labelled line (say()) is printed whole for the terminal to wrap.
    drawn = [line for line in text.splitlines() if re.search("[│┃─━]", line)]
    assert max((len(line) for line in drawn), default=0) <= 80, text
    assert missing(text, *values) == [], text


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


class TestTheCheck:
    def test_it_fails_on_rich_s_default_table_which_cuts(self) -> None:
        out = Console(width=80, record=True, color_system=None)
        table = Table("key", "used", "limit")
        table.add_row(KEYS[0], str(BIG), f"{BIG:,}")
        out.print(table)
        assert missing(out.export_text(), KEYS[0], str(BIG)) != []

    def test_it_reads_a_folded_cell_whole(self) -> None:
        out = Console(width=30, record=True, color_system=None)
        table = Table()
        table.add_column("key", overflow="fold")
        table.add_column("n", overflow="fold")
        table.add_row(KEYS[0], str(BIG))
        out.print(table)
        assert missing(out.export_text(), KEYS[0], str(BIG)) == []


class TestAt80Columns:
    def test_policy_list(self, monkeypatch: pytest.MonkeyPatch) -> None:
        policies = big_policies()
        monkeypatch.setattr(
            "spendgate.streams.policy_admin.list_policies", lambda *_, **__: policies
        )
        text = _cli("policy", "list")
        assert_whole(text, *(p.id for p in policies), str(BIG), "claude-opus-*")

    def test_budgets(self, monkeypatch: pytest.MonkeyPatch) -> None:
        async def top_budgets(*_: Any, **__: Any) -> Any:
            return big_rows()

        monkeypatch.setattr("spendgate.budgets.top_budgets", top_budgets)
        assert_whole(_cli("budgets"), *KEYS, f"{BIG:,}", f"{BIG} s")

    def test_alerts_tail(self, monkeypatch: pytest.MonkeyPatch) -> None:
        async def read_alerts(*_: Any, **__: Any) -> AsyncIterator[Any]:
            for key in KEYS:
                yield big_alert(key)

        monkeypatch.setattr("spendgate.streams.alert_feed.read_alerts", read_alerts)
        assert_whole(_cli("alerts", "tail", "--no-follow"), *KEYS, str(BIG))

    def test_simulate_with_compare(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setattr("spendgate.simulate.run_simulation", lambda *_, **__: big_report())
        monkeypatch.setattr(
            "spendgate.streams.policy_admin.list_policies", lambda *_, **__: big_policies()
        )
        draft = tmp_path / "draft.yaml"
        draft.write_text("- {id: opus-requests-30s, unit: requests, limit: 5, window: 1m}\n")
        text = _cli("simulate", "--policies", str(draft), "--compare")
        ids = [p.id for p in big_policies()]
        assert_whole(text, *KEYS, *ids, str(BIG), "2026-01-02T03:04:05Z")

    def test_dev_status(self, monkeypatch: pytest.MonkeyPatch) -> None:
        services = [
            ServiceStatus(name="kafka", pid=BIG, port=65535, running=True, log=LOG),
            ServiceStatus(name="redis", pid=None, port=6379, running=False, log=LOG),
        ]
        monkeypatch.setattr(LocalStack, "status", lambda self: services)
        lag = WorkerLag(records_behind=BIG, measured_at_ms=BIG, age_ms=BIG)
        marks = [
            PartitionStatus(
                field=f"usage:{n}",
                topic="usage",
                partition=n,
                state="stale",
                watermark_ms=BIG,
                age_ms=BIG,
                lag=lag,
                owner_token=BIG,
            )
            for n in range(2)
        ]
        status = StackStatus(
            decidable=False, reason="2 of 2 marks not vouched", redis_time_ms=BIG,
            staleness_ms=BIG, topology=TopologyCounts(usage=2, keyed=0), policies=6,
            counts={"stale": 2}, partitions=marks,
        )  # fmt: skip
        monkeypatch.setattr(
            "spendgate._cli_output.read_decidability", lambda: Decidability("sg:", status)
        )
        body = {"partitions": [{"field": "usage:0", "state": "vouched"}]}
        monkeypatch.setattr(
            "spendgate._cli_output.read_worker_readiness",
            lambda: Readiness("http://127.0.0.1:9464/readyz", 200, body),
        )
        assert_whole(_cli("dev", "status"), str(LOG), str(BIG), "usage:0", "usage:1")

    def test_dev_cluster_status(self, monkeypatch: pytest.MonkeyPatch) -> None:
        nodes = [NodeStatus(port=7100 + n, pid=BIG, running=True, role="replica", log=LOG)
                 for n in range(3)]  # fmt: skip
        monkeypatch.setattr(LocalCluster, "status", lambda self: nodes)
        monkeypatch.setattr(LocalCluster, "healthy", lambda self: True)
        assert_whole(_cli("dev", "cluster", "status"), str(LOG), str(BIG), "127.0.0.1:7102")

    def test_the_demo_table(self) -> None:
        views = {k: KeyView(limit=BIG, used=BIG, unit="total_tokens", window_s=30) for k in KEYS}
        tally = Tally(admitted=BIG, refused=BIG, keys=views, last_retry={KEYS[0]: f"{BIG}s"})
        out = Console(width=80, record=True, color_system=None)
        out.print(key_table(tally, 40.0))
        assert_whole(out.export_text(), *KEYS, f"{BIG:,}", f"{BIG}s")

    def test_the_demo_table_breaks_a_key_only_at_its_separators(self) -> None:
        views = {
            k: KeyView(limit=60000, used=41234, unit="total_tokens", window_s=30) for k in KEYS
        }
        out = Console(width=80, record=True, color_system=None)
        out.print(key_table(Tally(keys=views), 40.0))
        cells = [line.split("│")[1].strip() for line in out.export_text().splitlines()
                 if line.count("│") > 2]  # fmt: skip
        for key in KEYS:
            policy, *fields = key.split("|")
            assert f"{policy}|{'|'.join(fields[:-1])}|" in cells and fields[-1] in cells, cells


class TestProgress:
    def test_no_bar_off_a_terminal(self) -> None:
        out = Console(file=io.StringIO(), width=80)
        with progress("replaying usage", out) as done:
            done(5, 10)
        assert out.file.getvalue() == ""  # type: ignore[attr-defined]

    def test_a_bar_on_a_terminal(self) -> None:
        out = Console(file=io.StringIO(), width=80, force_terminal=True)
        with progress("replaying usage", out) as done:
            done(5, 10)
        assert "replaying usage" in out.file.getvalue()  # type: ignore[attr-defined]
