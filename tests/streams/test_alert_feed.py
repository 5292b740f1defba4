"""``spendgate alerts tail``: one readable line for every alert kind."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, get_args

import pytest

from spendgate.schemas.alerts import Alert, AlertKind
from spendgate.streams.alert_feed import describe

AT = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)

#: Each kind with the fields it carries, and what its line must say.
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "threshold": ({"threshold": 0.8}, "crossed 80%"),
    "exhausted": ({}, "exhausted"),
    "forecast": ({"exhausts_in_seconds": 42}, "exhausts in 42s"),
    "reservation_expired": ({"reservation_id": "r-1"}, "reservation r-1 expired"),
    "overage": (
        {"estimate": 200, "reserved": 200, "actual": 500},
        "committed 500 over an estimate of 200",
    ),
    "store_failure": ({}, "store unreachable"),
}


class TestDescribe:
    def test_every_kind_has_a_case(self) -> None:
        assert set(CASES) == set(get_args(AlertKind))

    @pytest.mark.parametrize("kind", sorted(CASES))
    def test_each_kind_reads_as_one_line_with_its_figures(self, kind: str) -> None:
        fields, said = CASES[kind]
        alert = Alert(
            alert_id="a1", kind=kind, policy="p", key="p|tenant=t", used=90, limit=100, at=AT,
            **fields,
        )  # fmt: skip
        line = describe(alert)
        assert said in line and "used 90/100 (90%)" in line and "\n" not in line, line

    def test_a_forecast_without_its_horizon_says_so(self) -> None:
        alert = Alert(alert_id="a1", kind="forecast", policy="p", key="k", used=1, limit=2, at=AT)
        assert "heading for the limit" in describe(alert)
