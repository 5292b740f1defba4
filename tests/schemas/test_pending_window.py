"""Pending reservations age out of the window like absorbed usage (issue 16, defect 1)."""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction

from hypothesis import example, given
from hypothesis import strategies as st

from spendgate.schemas.window_codec import decode_pending, pending_field
from spendgate.schemas.windows import (
    BOUNDARIES,
    WindowSpec,
    combine,
    merge,
    retry_after,
)

# Example counts come from the hypothesis profiles in tests/conftest.py (CI=true: 2000).

Event = tuple[int, int]  # (occurred_ms, amount >= 0)
SECOND = 1000
T0 = 1_700_000_000_000


def bucketed(events: list[Event], bucket_ms: int) -> dict[int, int]:
    """Bucket start -> summed amount, from first principles."""
    out: defaultdict[int, int] = defaultdict(int)
    for occurred, amount in events:
        out[occurred - occurred % bucket_ms] += amount
    return {k: v for k, v in out.items() if v}


def fields(events: list[Event], bucket_ms: int) -> dict[str, int]:
    """The pending-window hash as Redis holds it: a bucket's last ms -> amount."""
    out: defaultdict[str, int] = defaultdict(int)
    for occurred, amount in events:
        out[str(occurred - occurred % bucket_ms + bucket_ms - 1)] += amount
    return dict(out)


def reference_total(spec: WindowSpec, events: list[Event], t_ms: int) -> int:
    """The bucketed total at ``t_ms``: each bucket's overlap with ``(t - W, t]``."""
    first_ms = t_ms - spec.window_ms + 1
    result = 0
    for start, amount in bucketed(events, spec.bucket_ms).items():
        low, high = max(start, first_ms), min(start + spec.bucket_ms - 1, t_ms)
        if start > t_ms or low > high:
            continue
        if start >= first_ms or spec.boundary == "include":
            result += amount
        elif spec.boundary == "prorate":
            result += math.ceil(Fraction(amount * (high - low + 1), spec.bucket_ms))
    return result


class TestPendingLayout:
    def test_a_field_is_the_last_millisecond_of_the_admission_bucket(self) -> None:
        assert pending_field(T0 + 1_234, 1000) == T0 + 1_999
        minute = 1_700_000_040_000  # a whole minute
        assert pending_field(minute + 59_999, 60_000) == minute + 59_999
        assert pending_field(minute + 60_000, 60_000) == minute + 60_000 + 59_999

    def test_fields_are_read_in_the_policys_width(self) -> None:
        raw = {b"1999": b"5", "2999": "7", "5999": 0, "59999": 11}
        assert decode_pending(raw, 1000) == {1000: 5, 2000: 7, 59_000: 11}
        # A coarser width: each field lands in the bucket holding its last millisecond.
        assert decode_pending(raw, 5000) == {0: 12, 55_000: 11}

    def test_a_field_after_now_counts_now_and_until_its_last_millisecond(self) -> None:
        # Held in an hour bucket now read in minutes (or at a clock that went back): it is
        # in the minute of its last millisecond, which has not begun, and counts at once.
        hour = 1_699_999_200_000  # a whole hour
        raw = {str(hour + 3_599_999): 40}
        now = hour + 1_234_567
        spec = WindowSpec(3_600_000, 60_000, "include")
        assert decode_pending(raw, 60_000) == {hour + 3_540_000: 40}
        assert combine(spec, {}, decode_pending(raw, 60_000), now).pending == 40
        # And until that minute leaves the window.
        gone = hour + 3_540_000 + 3_600_000 + 60_000 - 1
        assert combine(spec, {}, decode_pending(raw, 60_000), gone - 1).pending == 40
        assert combine(spec, {}, decode_pending(raw, 60_000), gone).pending == 0


class TestCombine:
    def test_pending_and_absorbed_add_bucket_by_bucket(self) -> None:
        spec = WindowSpec(10_000, 1000, "include")
        held = combine(spec, {T0: 5, T0 + 1000: -5}, {T0 + 1000: 5, T0 + 2000: 3}, T0 + 2_500)
        assert held.buckets == {T0: 5, T0 + 2000: 3}
        assert (held.absorbed, held.pending, held.used) == (0, 8, 0)

    def test_pending_buckets_that_left_the_window_are_dropped(self) -> None:
        spec = WindowSpec(10_000, 1000, "include")
        held = combine(spec, {}, {T0 - 20_000: 100, T0: 1}, T0 + 500)
        assert held.buckets == {T0: 1}
        assert held.pending == 1

    def test_over_refunds_make_no_room(self) -> None:
        spec = WindowSpec(10_000, 1000, "exclude")
        held = combine(spec, {T0: -50}, {T0: 30}, T0)
        assert (held.absorbed, held.used, held.pending) == (-50, 0, 30)

    def test_merge_drops_zero_sums(self) -> None:
        assert merge({1: 2, 3: 4}, {1: -2, 5: 1}) == {3: 4, 5: 1}


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[WindowSpec, list[Event], list[Event], int, int, int]:
    bucket_ms = draw(st.integers(1, 5)) * SECOND
    spec = WindowSpec(
        draw(st.integers(1, 12)) * bucket_ms, bucket_ms, draw(st.sampled_from(BOUNDARIES))
    )
    t_ms = T0 + draw(st.integers(0, 10 * bucket_ms))
    # Everything was admitted at or before the decision: the Redis clock only goes on.
    at = st.integers(t_ms - 2 * spec.window_ms, t_ms)
    event = st.tuples(at, st.integers(0, 1000))
    absorbed = draw(st.lists(event, max_size=12))
    pending = draw(st.lists(event, max_size=12))
    limit = draw(st.integers(0, 6000))
    amount = draw(st.integers(0, limit))
    return spec, absorbed, pending, t_ms, limit, amount


class TestRetryAfterWithPending:
    @given(scenarios())
    @example((WindowSpec(60_000, 1000, "include"), [], [(T0 + 400, 600)], T0 + 450, 1000, 600))
    def test_exact_and_within_window_plus_bucket(
        self, scenario: tuple[WindowSpec, list[Event], list[Event], int, int, int]
    ) -> None:
        spec, absorbed, pending, t_ms, limit, amount = scenario
        held = combine(
            spec,
            bucketed(absorbed, spec.bucket_ms),
            decode_pending(fields(pending, spec.bucket_ms), spec.bucket_ms),
            t_ms,
        )
        everything = absorbed + pending
        assert held.absorbed == reference_total(spec, absorbed, t_ms)
        assert held.used + held.pending == reference_total(spec, everything, t_ms)

        answer = retry_after(spec, held.buckets, t_ms, limit=limit, amount=amount)
        assert not answer.never_fits
        fits_at = answer.fits_at_ms
        assert fits_at is not None, "with amount <= limit, aging alone always makes room"
        assert t_ms <= fits_at <= t_ms + spec.window_ms + spec.bucket_ms
        assert reference_total(spec, everything, fits_at) + amount <= limit
        if fits_at > t_ms:
            assert reference_total(spec, everything, fits_at - 1) + amount > limit
