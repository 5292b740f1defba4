"""``--output json`` on every listing command: JSON on stdout and nothing else there, every
key and digit as the data holds it (no Kafka or Redis: the readers are replaced)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from spendgate.cli import app
from tests.fixtures.admission import free_port
from tests.fixtures.wide import (
    BIG,
    big_alert,
    big_policies,
    big_report,
    big_rows,
    longest_demo_keys,
)


def _json(*args: str) -> Any:
    result = CliRunner().invoke(app, list(args), terminal_width=80)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


class TestPolicyList:
    def test_every_field_of_every_policy(self, monkeypatch: pytest.MonkeyPatch) -> None:
        policies = big_policies()
        monkeypatch.setattr(
            "spendgate.streams.policy_admin.list_policies", lambda *_, **__: policies
        )
        assert _json("policy", "list", "-o", "json") == [
            p.model_dump(mode="json") for p in policies
        ]


class TestBudgets:
    @pytest.fixture(autouse=True)
    def _rows(self, monkeypatch: pytest.MonkeyPatch) -> None:
        async def top_budgets(*_: Any, **__: Any) -> Any:
            return big_rows()

        monkeypatch.setattr("spendgate.budgets.top_budgets", top_budgets)

    def test_the_rows_as_the_dashboard_serves_them(self) -> None:
        listed = _json("budgets", "--output", "json")
        assert listed == [r.as_json() for r in big_rows()]
        assert [r["key"] for r in listed] == longest_demo_keys()
        assert {r["used"] for r in listed} == {BIG}

    def test_watch_prints_one_line_per_refresh(self, monkeypatch: pytest.MonkeyPatch) -> None:
        sleeps: list[float] = []

        def sleep(s: float) -> None:
            sleeps.append(s)
            if len(sleeps) == 2:
                raise KeyboardInterrupt

        monkeypatch.setattr("time.sleep", sleep)
        result = CliRunner().invoke(app, ["budgets", "-o", "json", "--watch", "--interval", "1"])
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert len(lines) == 2
        assert all(json.loads(line) == [r.as_json() for r in big_rows()] for line in lines)


class TestAlertsTail:
    def test_one_object_per_line_as_on_the_topic(self, monkeypatch: pytest.MonkeyPatch) -> None:
        alerts = [big_alert(k) for k in longest_demo_keys()]

        async def read_alerts(*_: Any, **__: Any) -> AsyncIterator[Any]:
            for alert in alerts:
                yield alert

        monkeypatch.setattr("spendgate.streams.alert_feed.read_alerts", read_alerts)
        result = CliRunner().invoke(app, ["alerts", "tail", "--no-follow", "-o", "json"])
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert [json.loads(line) for line in lines] == [a.model_dump(mode="json") for a in alerts]


class TestDevStatus:
    def test_services_decidability_and_worker_with_nothing_running(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.setenv("SPENDGATE_STACK_DIR", str(tmp_path))
        # Port 1 refuses at once: both reads fail fast and say why.
        monkeypatch.setenv("SPENDGATE_REDIS_URL", "redis://127.0.0.1:1/0")
        monkeypatch.setenv("SPENDGATE_METRICS_PORT", "1")
        status = _json("dev", "status", "-o", "json")
        assert [(s["name"], s["running"], s["pid"]) for s in status["services"]] == [
            ("kafka", False, None),
            ("redis", False, None),
        ]
        assert all(s["log"].startswith(str(tmp_path)) for s in status["services"])
        assert status["decidable"]["error"].startswith("Redis at redis://127.0.0.1:1/0")
        assert status["worker"] == {
            "url": "http://127.0.0.1:1/readyz",
            "ready": None,
            "status_code": None,
            "body": None,
            "error": "ConnectError",
        }

    def test_the_cluster_nodes_with_nothing_running(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.setenv("SPENDGATE_STACK_DIR", str(tmp_path))
        # Ports of its own: the suite's shared dev cluster (7100...) may be running now.
        monkeypatch.setenv("SPENDGATE_CLUSTER_PORT", str(free_port()))
        status = _json("dev", "cluster", "status", "-o", "json")
        assert status["healthy"] is False
        assert {n["running"] for n in status["nodes"]} == {False}


class TestSimulate:
    def test_output_json_is_the_json_flag(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.setattr("spendgate.simulate.run_simulation", lambda *_, **__: big_report())
        draft = tmp_path / "draft.yaml"
        draft.write_text("- {id: d, match: {}, unit: requests, limit: 5, window: 1m}\n")
        flag = _json("simulate", "--policies", str(draft), "--json")
        assert _json("simulate", "--policies", str(draft), "--output", "json") == flag
        assert flag == json.loads(json.dumps(big_report().to_json(5)))
