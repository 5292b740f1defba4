"""When is an amount charged: estimate at admit, extends at their instants, overage at commit.

The oracle below never calls the code it judges: it expands a reservation into single
units, each charged at the instant it was asked for (the estimate's units at the admission
instant, each extend's at its own instant), lets the actual keep the oldest units, drops
the rest, and charges any units beyond the reservation at the commit's instant. Totals
then come from ``tests/schemas/reference.py`` (first principles, no engine code).
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.windows import BOUNDARIES, WindowSpec, retry_after, settle, total
from spendgate.streams.fold import _may_outgrow
from spendgate.streams.ledger import KeyedRecord, KeyState, apply
from tests.schemas import reference

OFFSETS = itertools.count(1)

Charge = tuple[int, int]  # (occurred_ms, signed amount)


def oracle_units(slices: list[tuple[int, int]], actual: int, commit_ms: int) -> list[Charge]:
    """The charges a settled reservation leaves, one unit at a time (no engine code)."""
    units = [ms for ms, amount in sorted(slices) for _ in range(amount)]
    kept = units[:actual]
    kept += [commit_ms] * (actual - len(units))
    return [(ms, 1) for ms in kept]


def record(kind: str, at: int, amount: int, spec: WindowSpec, **extra: Any) -> KeyedRecord:
    return KeyedRecord(
        event_id=extra.pop("event_id", f"{kind}-{next(OFFSETS)}"),
        kind=kind,  # type: ignore[arg-type]
        policy="p",
        key="p|tenant=a",
        occurred_ms=at,
        amount=amount,
        window_ms=spec.window_ms,
        bucket_ms=spec.bucket_ms,
        limit=10**9,
        src_partition=0,
        src_offset=next(OFFSETS),
        boundary=spec.boundary,
        reservation_id="r1",
        **extra,
    )


_SPECS = st.builds(
    lambda bucket_s, buckets, boundary: WindowSpec(
        buckets * bucket_s * 1000, bucket_s * 1000, boundary
    ),
    st.integers(1, 5),
    st.integers(1, 6),
    st.sampled_from(BOUNDARIES),
)
# Gaps between successive instants: often inside one bucket, sometimes past the window.
_GAPS = st.integers(0, 3_000) | st.integers(0, 40_000)


@st.composite
def streams_of(draw: st.DrawFn) -> tuple[WindowSpec, list[tuple[int, int]], int, int]:
    """A window, the reservation's slices (estimate first, then extends), actual, commit."""
    spec = draw(_SPECS)
    at = draw(st.integers(0, 10**7))
    slices = []
    for amount in draw(st.lists(st.integers(0, 40), min_size=1, max_size=6)):
        slices.append((at, amount))
        at += draw(_GAPS)
    commit_ms = at
    actual = draw(st.integers(0, 200))
    return spec, slices, actual, commit_ms


def applied(spec: WindowSpec, slices: list[tuple[int, int]], actual: int, commit_ms: int):  # type: ignore[no-untyped-def]
    state = KeyState()
    (t0, estimate), extends = slices[0], slices[1:]
    apply(state, record("reserve", t0, estimate, spec, expires_ms=t0 + 10**9))
    for seq, (ms, amount) in enumerate(extends, 1):
        apply(state, record("extend", ms, amount, spec, event_id=f"extend-{seq}-r1"))
    change = apply(state, record("commit", commit_ms, actual, spec))
    return state, change


class TestSettle:
    @given(
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 30)), max_size=6),
        st.integers(0, 150),
        st.integers(10**6, 2 * 10**6),
    )
    def test_the_charges_leave_exactly_the_units_the_oracle_keeps(
        self, slices: list[tuple[int, int]], actual: int, commit_ms: int
    ) -> None:
        slices.sort()
        charges, overage = settle(slices, actual, commit_ms)
        left: dict[int, int] = {}
        for ms, amount in [*slices, *charges]:
            left[ms] = left.get(ms, 0) + amount
        expected: dict[int, int] = {}
        for ms, amount in oracle_units(slices, actual, commit_ms):
            expected[ms] = expected.get(ms, 0) + amount
        assert {k: v for k, v in left.items() if v} == expected
        assert overage == max(0, actual - sum(a for _, a in slices))

    def test_an_aged_part_is_filled_first_and_refunds_nothing(self) -> None:
        assert settle([(5, 10)], 4, 9, aged=6) == ([(5, -10)], 0)
        assert settle([(5, 10)], 20, 9, aged=6) == ([(9, 4)], 4)


class TestLedgerAgainstTheOracle:
    @given(streams_of())
    def test_the_window_after_commit_is_what_the_oracle_charges(
        self, case: tuple[WindowSpec, list[tuple[int, int]], int, int]
    ) -> None:
        spec, slices, actual, commit_ms = case
        state, change = applied(spec, slices, actual, commit_ms)
        # Slices arrive in time order, so the key still holds the reservation at its commit
        # (however many of its slices aged out). What the worker pruned meanwhile is gone
        # from its state, not from the oracle: compare what windows from the commit on see.
        units = oracle_units(slices, actual, commit_ms)
        for later in (0, spec.bucket_ms - 1, spec.bucket_ms, spec.window_ms // 2):
            t = commit_ms + later
            assert total(spec, state.buckets, t) == reference.reference_total(
                spec.window_ms, spec.bucket_ms, spec.boundary, units, t
            ), t
        reserved = sum(a for _, a in slices)
        if actual > reserved:
            assert change.overage is not None
            assert change.overage == (slices[0][1], reserved, actual)
        else:
            assert change.overage is None

    @given(streams_of())
    def test_an_overage_counts_in_the_window_of_the_commit(
        self, case: tuple[WindowSpec, list[tuple[int, int]], int, int]
    ) -> None:
        spec, slices, actual, commit_ms = case
        state, _ = applied(spec, slices, actual, commit_ms)
        over = max(0, actual - sum(a for _, a in slices))
        # However old the reservation, its overage is charged now: never free.
        assert total(spec, state.buckets, commit_ms) >= over

    @given(streams_of(), st.integers(1, 400))
    def test_retry_after_stays_within_window_plus_bucket(
        self, case: tuple[WindowSpec, list[tuple[int, int]], int, int], limit: int
    ) -> None:
        spec, slices, actual, commit_ms = case
        state, _ = applied(spec, slices, actual, commit_ms)
        amount = limit // 2
        answer = retry_after(spec, state.buckets, commit_ms, limit=limit, amount=amount)
        assert answer.fits_at_ms is not None
        assert answer.fits_at_ms - commit_ms <= spec.window_ms + spec.bucket_ms


class TestExamples:
    SPEC = WindowSpec(60_000, 5_000)

    def test_a_stream_pays_for_each_extend_in_the_bucket_it_was_asked(self) -> None:
        state, change = applied(self.SPEC, [(1_000, 10), (31_000, 10), (61_000, 10)], 25, 62_000)
        assert state.buckets == {0: 10, 30_000: 10, 60_000: 5}
        assert change.overage is None

    def test_an_overage_lands_at_the_commit_not_in_the_reservations_bucket(self) -> None:
        state, change = applied(self.SPEC, [(1_000, 10)], 25, 50_000)
        assert state.buckets == {0: 10, 50_000: 15}
        assert change.overage == (10, 10, 25)

    def test_an_overage_of_an_aged_reservation_is_still_charged(self) -> None:
        # The estimate's bucket left the window; a later extend keeps the reservation known.
        state, change = applied(self.SPEC, [(1_000, 10), (50_000, 5)], 40, 70_000)
        assert state.buckets == {50_000: 5, 70_000: 25}
        assert change.overage == (10, 15, 40)

    def test_a_reservation_the_key_forgot_is_charged_in_full_at_its_commit(self) -> None:
        # Other traffic moved the key's clock past every slice: the reservation is gone.
        spec = self.SPEC
        state = KeyState()
        apply(state, record("reserve", 1_000, 10, spec, expires_ms=900_000))
        other = record("commit", 70_000, 1, spec)
        apply(state, KeyedRecord(**{**other.to_json(), "thresholds": (), "reservation_id": None}))
        assert state.reservations == {}
        change = apply(state, record("commit", 71_000, 25, spec))
        assert state.buckets == {70_000: 26}
        assert change.overage is None


class TestOrderAndBounds:
    SPEC = WindowSpec(60_000, 5_000)

    def test_an_extend_before_its_reserve_is_charged_and_the_reserve_joins_it(self) -> None:
        # A reserve republished late by the sweeper reaches the log after its extend.
        state = KeyState()
        apply(state, record("extend", 6_000, 20, self.SPEC, event_id="extend-1-r1"))
        assert state.reservations["r1"].expires_ms == 0  # no expiry alert before the reserve
        apply(state, record("reserve", 1_000, 10, self.SPEC, expires_ms=900_000))
        held = state.reservations["r1"]
        assert (held.estimate, held.reserved, held.expires_ms) == (10, 30, 900_000)
        change = apply(state, record("commit", 7_000, 15, self.SPEC))
        # Oldest first: the reserve's slice (bucket 0) is kept, the extend's refunded to 5.
        assert state.buckets == {0: 10, 5_000: 5}
        assert change.overage is None

    def test_an_extend_after_its_commit_charges_nothing(self) -> None:
        state = KeyState()
        apply(state, record("reserve", 1_000, 10, self.SPEC, expires_ms=900_000))
        apply(state, record("commit", 2_000, 10, self.SPEC))
        late = record("extend", 3_000, 20, self.SPEC, event_id="extend-1-r1", settled=True)
        change = apply(state, late)
        assert state.buckets == {0: 10} and state.reservations == {}
        assert change.absorbed == "extend-1-r1"  # its pending entry still leaves Redis

    def test_a_long_stream_keeps_one_slice_per_bucket_and_its_size_bound_holds(self) -> None:
        state = KeyState()
        apply(state, record("reserve", 0, 10, self.SPEC, expires_ms=10**9))
        for seq in range(1, 400):  # an extend every second for 400 s on a 60 s window
            rec = record("extend", seq * 1_000, 7, self.SPEC, event_id=f"extend-{seq}-r1")
            before = KeyState.from_bytes(state.to_bytes())
            apply(state, rec)
            # The fold's cheap size bound never under-estimates the state a record makes.
            assert _may_outgrow(before, rec, len(state.to_bytes()) - 1)
        held = state.reservations["r1"]
        assert len(held.slices) <= 60_000 // 5_000 + 1  # one per bucket still in the window
        assert held.reserved == 10 + 399 * 7
