"""The per-key ledger: redelivery by position, reservation lifecycle, late events, format."""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from spendgate.schemas import window_codec
from spendgate.streams.ledger import Hold, KeyedRecord, KeyState, apply

OFFSETS = itertools.count(1)

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
        limit=1000,
        **{"src_partition": 0, "src_offset": next(OFFSETS), **extra},
    )


def total(state: KeyState) -> int:
    return sum(state.buckets.values())


class TestRedelivery:
    def test_a_record_at_or_below_the_partitions_offset_changes_nothing(self) -> None:
        state = KeyState()
        first = rec("e1", src_offset=10)
        assert apply(state, first).outcome == "applied"
        assert apply(state, first).outcome == "redelivery"
        assert apply(state, rec("e0", src_offset=9)).outcome == "redelivery"
        assert total(state) == 10
        assert state.offsets == {0: 10}

    def test_offsets_are_kept_per_source_partition(self) -> None:
        state = KeyState()
        apply(state, rec("a", src_partition=0, src_offset=10))
        assert apply(state, rec("b", src_partition=1, src_offset=3)).outcome == "applied"
        assert state.offsets == {0: 10, 1: 3}
        assert total(state) == 20

    def test_a_redelivery_asks_for_the_window_to_be_written_again(self) -> None:
        state = KeyState()
        r = rec("r", "reserve", amount=50, reservation_id="x", expires_ms=200_000)
        apply(state, r)
        again = apply(state, r)
        assert again.outcome == "redelivery" and again.buckets_changed
        assert again.absorbed == "x"

    def test_a_late_dropped_record_still_moves_the_offset(self) -> None:
        state = KeyState()
        apply(state, rec("new", at=100_000))
        late = rec("old", at=1_000)
        assert apply(state, late).outcome == "late_dropped"
        assert apply(state, late).outcome == "redelivery"


class TestStateFormat:
    def test_state_survives_a_round_trip(self) -> None:
        state = KeyState()
        apply(state, rec("e1"))
        apply(state, rec("r", "reserve", reservation_id="x", expires_ms=200_000))
        state.above.add("t0.5")
        state.crossings["t0.5"] = 1
        again = KeyState.from_bytes(state.to_bytes())
        assert again == state

    def test_the_value_starts_with_its_version_and_holds_the_codec_buckets(self) -> None:
        state = KeyState()
        apply(state, rec("e1", at=100_000, amount=7))
        value = state.to_bytes()
        assert value[0] == 2
        n = int.from_bytes(value[1:5], "little")
        assert window_codec.decode(value[5 : 5 + n]).buckets == {100_000: 7}

    def test_a_version_1_value_is_converted(self) -> None:
        v1 = {
            "b": {"100000": 20, "95000": -3},
            "seen": {f"e{i}": 100_000 for i in range(1000)},
            "res": {"x": [100_000, 50, 200_000]},
            "settled": {"y": 99_000},
            "hwm": 100_000,
            "bw": BUCKET,
            "ww": WINDOW,
            "x": {"t0.5": 2},
            "above": ["t0.5"],
            "exp": [],
        }
        state = KeyState.from_bytes(orjson.dumps(v1))
        assert state.buckets == {100_000: 20, 95_000: -3}
        assert state.reservations == {"x": Hold(200_000, ((100_000, 50),), 0, 50)}
        assert (state.high_ms, state.bucket_ms, state.window_ms) == (100_000, BUCKET, WINDOW)
        assert state.crossings == {"t0.5": 2} and state.above == {"t0.5"}
        assert state.offsets == {}
        # The converted state goes on: it is written back in version 2, without the ids.
        assert apply(state, rec("c", "commit", amount=30, reservation_id="x")).outcome == "applied"
        assert 100_000 not in state.buckets  # 20 + (30 - 50): the estimate was replaced
        assert len(state.to_bytes()) < len(orjson.dumps(v1)) / 10

    def test_an_unknown_version_is_refused(self) -> None:
        import pytest

        with pytest.raises(ValueError, match="format 9"):
            KeyState.from_bytes(bytes([9]) + b"\x00" * 8)

    def test_size_depends_on_the_window_not_on_history(self) -> None:
        # One key, a 1 h window of 1 min buckets, 20,000 events over 10 hours.
        state = KeyState()
        sizes = []
        for i in range(20_000):
            at = 3_600_000 + i * 1_800
            r = KeyedRecord(
                event_id=f"e{i}",
                kind="commit",
                policy="p",
                key="k",
                occurred_ms=at,
                amount=3,
                window_ms=3_600_000,
                bucket_ms=60_000,
                limit=10**9,
                src_partition=0,
                src_offset=i,
            )
            apply(state, r)
            if i % 2_000 == 1_999:
                sizes.append(len(state.to_bytes()))
        # 60 or 61 live buckets at any time once the first hour is full.
        assert max(sizes[1:]) - min(sizes[1:]) <= 16
        assert max(sizes) <= 2_048


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

    def test_a_reserve_marked_settled_charges_nothing_but_absorbs_its_entry(self) -> None:
        # The fan-out marks a reserve settled when its commit arrived first.
        state = KeyState()
        apply(state, rec("c", "commit", amount=20, reservation_id="x"))
        change = apply(
            state,
            rec("r", "reserve", amount=50, reservation_id="x", expires_ms=200_000, settled=True),
        )
        assert total(state) == 20
        assert change.absorbed == "x"
        assert state.reservations == {}

    def test_a_redelivered_reserve_still_reports_the_pending_entry_absorbed(self) -> None:
        state = KeyState()
        r = rec("r", "reserve", amount=50, reservation_id="x", expires_ms=200_000)
        apply(state, r)
        assert apply(state, r).absorbed == "x"
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
