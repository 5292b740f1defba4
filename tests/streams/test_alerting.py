"""Alert rules: once per crossing, re-armed under the line, deterministic ids."""

from __future__ import annotations

import itertools
from typing import Any

from spendgate.streams.alerting import evaluate
from spendgate.streams.ledger import KeyedRecord, KeyState, apply

OFFSETS = itertools.count()


def rec(event_id: str, at: int, amount: int, kind: str = "commit", **extra: Any) -> KeyedRecord:
    return KeyedRecord(
        event_id=event_id,
        kind=kind,
        policy="p",
        key="p|tenant=a",  # type: ignore[arg-type]
        occurred_ms=at,
        amount=amount,
        window_ms=60_000,
        bucket_ms=5_000,
        limit=100,
        src_partition=0,
        src_offset=next(OFFSETS),
        thresholds=(0.5, 0.8, 1.0),
        **extra,
    )


def run(records: list[KeyedRecord]) -> list[tuple[str, float | None, str]]:
    state = KeyState()
    out = []
    for r in records:
        apply(state, r)
        out += [(a.kind, a.threshold, a.alert_id) for a in evaluate(state, r)]
    return out


class TestThresholds:
    def test_each_threshold_fires_once_per_crossing(self) -> None:
        fired = run(
            [rec("a", 1_000, 40), rec("b", 2_000, 20), rec("c", 3_000, 5), rec("d", 4_000, 35)]
        )
        assert [(k, t) for k, t, _ in fired] == [
            ("threshold", 0.5),
            ("threshold", 0.8),
            ("threshold", 1.0),
            ("exhausted", None),
        ]

    def test_a_threshold_re_arms_after_usage_ages_out(self) -> None:
        fired = run([rec("a", 1_000, 60), rec("b", 70_000, 1), rec("c", 71_000, 60)])
        halves = [i for k, t, i in fired if t == 0.5]
        assert len(halves) == 2 and halves[0] != halves[1]

    def test_replaying_the_same_records_gives_the_same_ids(self) -> None:
        records = [rec("a", 1_000, 60), rec("b", 70_000, 1), rec("c", 71_000, 90)]
        assert run(records) == run(records)


class TestExpiry:
    def test_an_open_reservation_is_reported_once_when_the_key_clock_passes_expiry(
        self,
    ) -> None:
        fired = run(
            [
                rec("r", 1_000, 10, kind="reserve", reservation_id="x", expires_ms=20_000),
                rec("a", 19_000, 1),
                rec("b", 21_000, 1),
                rec("c", 22_000, 1),
            ]
        )
        assert [k for k, _, _ in fired] == ["reservation_expired"]

    def test_a_committed_reservation_never_expires(self) -> None:
        fired = run(
            [
                rec("r", 1_000, 10, kind="reserve", reservation_id="x", expires_ms=20_000),
                rec("c", 2_000, 8, reservation_id="x"),
                rec("a", 30_000, 1),
            ]
        )
        assert fired == []


def frec(event_id: str, at: int, amount: int) -> KeyedRecord:
    """A record of a policy with a 30 s forecast horizon and no thresholds."""
    return KeyedRecord(
        event_id=event_id,
        kind="commit",
        policy="p",
        key="p|tenant=a",
        occurred_ms=at,
        amount=amount,
        window_ms=60_000,
        bucket_ms=5_000,
        limit=100,
        src_partition=0,
        src_offset=next(OFFSETS),
        thresholds=(),
        forecast_ms=30_000,
    )


class TestForecastAlerts:
    # 60 s window, 5 s buckets: the burn rate looks at the last 2 buckets (10 s).
    def test_fires_once_per_crossing_and_re_arms_when_the_prediction_recedes(self) -> None:
        burst = [frec(f"a{i}", 1_000 + i * 1_000, 3) for i in range(9)]  # 3 per second
        # At 9 s: 27 used at 3/s; 73 more take ~24 s, within 30 s: one alert, then none
        # while the burst goes on.
        quiet = [frec("q", 75_000, 1)]  # the burst has aged out; 1 unit in 10 s
        again = [frec(f"b{i}", 76_000 + i * 1_000, 4) for i in range(9)]
        fired = run([*burst, *quiet, *again])
        kinds = [k for k, _, _ in fired]
        assert kinds == ["forecast", "forecast"]
        assert fired[0][2] != fired[1][2]

    def test_the_alert_says_when(self) -> None:
        state = KeyState()
        alerts = []
        for r in [frec(f"a{i}", 1_000 + i * 1_000, 3) for i in range(9)]:
            apply(state, r)
            alerts += evaluate(state, r)
        (alert,) = alerts
        assert alert.kind == "forecast" and alert.exhausts_in_seconds is not None
        assert 0 < alert.exhausts_in_seconds <= 30

    def test_no_horizon_no_forecast_alerts(self) -> None:
        records = [rec(f"a{i}", 1_000 + i * 1_000, 3) for i in range(9)]
        assert all(k != "forecast" for k, _, _ in run(records))


class TestOverage:
    def test_a_commit_above_its_reservation_is_reported_once_with_its_amounts(self) -> None:
        def alerts() -> list[Any]:
            state = KeyState()
            out = []
            for r in (
                rec("r", 1_000, 10, "reserve", reservation_id="x", expires_ms=900_000),
                rec("e", 2_000, 5, "extend", reservation_id="x"),
                rec("c", 30_000, 22, "commit", reservation_id="x"),
            ):
                change = apply(state, r)
                out += [a for a in evaluate(state, r, change.overage) if a.kind == "overage"]
            return out

        first, again = alerts(), alerts()
        assert len(first) == 1
        alert = first[0]
        assert (alert.estimate, alert.reserved, alert.actual) == (10, 15, 22)
        assert alert.reservation_id == "x" and alert.used == 22
        assert alert.at.timestamp() == 30.0  # the commit's instant
        assert [a.alert_id for a in again] == [alert.alert_id]  # replay: the same id

    def test_a_commit_within_its_reservation_is_no_overage(self) -> None:
        state = KeyState()
        apply(state, rec("r", 1_000, 10, "reserve", reservation_id="x", expires_ms=900_000))
        change = apply(state, c := rec("c", 2_000, 10, "commit", reservation_id="x"))
        assert change.overage is None
        assert not [a for a in evaluate(state, c, change.overage) if a.kind == "overage"]
