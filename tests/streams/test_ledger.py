"""The per-key ledger: dedupe, reservation lifecycle, late events."""

from __future__ import annotations

from typing import Any

from streams.ledger import KeyedRecord, KeyState, apply

BUCKET = 5_000
WINDOW = 60_000


def rec(
    event_id: str, kind: str = "commit", at: int = 100_000, amount: int = 10, **extra: Any
) -> KeyedRecord:
    return KeyedRecord(
        event_id=event_id,
        kind=kind,
        policy="p",
        key="p|tenant=a",  # type: ignore[arg-type]
        occurred_ms=at,
        amount=amount,
        window_ms=WINDOW,
        bucket_ms=BUCKET,
        horizon_ms=WINDOW + 3_600_000,
        limit=1000,
        **extra,
    )


def total(state: KeyState) -> int:
    return sum(state.buckets.values())


class TestDedupe:
    def test_a_repeated_event_id_changes_nothing(self) -> None:
        state = KeyState()
        assert apply(state, rec("e1")).outcome == "applied"
        assert apply(state, rec("e1")).outcome == "duplicate"
        assert total(state) == 10

    def test_state_survives_a_json_round_trip(self) -> None:
        state = KeyState()
        apply(state, rec("e1"))
        apply(state, rec("r", "reserve", reservation_id="x", expires_ms=200_000))
        again = KeyState.from_json(state.to_json())
        assert again == state
        assert apply(again, rec("e1")).outcome == "duplicate"


class TestReservations:
    def test_commit_replaces_the_estimate_in_the_reserve_bucket(self) -> None:
        state = KeyState()
        apply(
            state,
            rec("r", "reserve", at=100_000, amount=50, reservation_id="x", expires_ms=200_000),
        )
        change = apply(state, rec("c", "commit", at=112_000, amount=20, reservation_id="x"))
        assert state.buckets == {100_000: 20}
        assert change.touched == (100_000,)

    def test_release_frees_the_estimate(self) -> None:
        state = KeyState()
        apply(state, rec("r", "reserve", amount=50, reservation_id="x", expires_ms=200_000))
        apply(state, rec("l", "release", amount=0, reservation_id="x"))
        assert total(state) == 0

    def test_commit_before_its_reserve_settles_it(self) -> None:
        state = KeyState()
        apply(state, rec("c", "commit", amount=20, reservation_id="x"))
        change = apply(
            state, rec("r", "reserve", amount=50, reservation_id="x", expires_ms=200_000)
        )
        assert total(state) == 20
        assert change.absorbed == "x"

    def test_a_duplicate_reserve_still_reports_the_pending_entry_absorbed(self) -> None:
        state = KeyState()
        apply(state, rec("r", "reserve", amount=50, reservation_id="x", expires_ms=200_000))
        assert (
            apply(
                state, rec("r", "reserve", amount=50, reservation_id="x", expires_ms=200_000)
            ).absorbed
            == "x"
        )
        assert total(state) == 50


class TestLateEvents:
    def test_a_late_event_inside_the_window_lands_in_its_own_bucket(self) -> None:
        state = KeyState()
        apply(state, rec("new", at=100_000))
        apply(state, rec("late", at=71_000))
        assert state.buckets == {100_000: 10, 70_000: 10}

    def test_an_event_older_than_the_window_is_dropped(self) -> None:
        state = KeyState()
        apply(state, rec("new", at=100_000))
        # Its bucket [30 s, 35 s) lies wholly before every window from t = 100 s on.
        assert apply(state, rec("old", at=34_000)).outcome == "late_dropped"
        assert total(state) == 10

    def test_buckets_that_left_the_window_are_pruned(self) -> None:
        state = KeyState()
        apply(state, rec("a", at=10_000))
        change = apply(state, rec("b", at=80_000))
        assert change.pruned
        assert state.buckets == {80_000: 10}


class TestPolicyChanges:
    def test_a_new_bucket_width_moves_amounts_to_the_bucket_holding_their_end(self) -> None:
        state = KeyState()
        apply(state, rec("a", at=100_000))  # 5 s buckets: [100 s, 105 s)
        wide = KeyedRecord.from_json({**rec("b", at=101_000).to_json(), "bucket_ms": 10_000})
        apply(state, wide)
        # [100 s, 105 s) ends at 104.999 s, inside the 10 s bucket [100 s, 110 s).
        assert state.buckets == {100_000: 20}
        assert state.bucket_ms == 10_000

    def test_narrower_buckets_never_age_usage_out_earlier(self) -> None:
        state = KeyState()
        ten = {**rec("a", at=100_000).to_json(), "bucket_ms": 10_000}
        apply(state, KeyedRecord.from_json(ten))
        apply(state, rec("b", at=109_000))
        assert state.buckets == {105_000: 20}
