"""Example-based tests of the pure window engine."""

from __future__ import annotations

import pytest

from spendgate.schemas.windows import (
    MAX_BUCKET_MS,
    Boundary,
    Buckets,
    RetryAfter,
    WindowSpec,
    add,
    boundary_usage,
    prune,
    retry_after,
    total,
)

MINUTE = 60_000
TEN_S = 10_000


def one_minute(boundary: Boundary = "include") -> WindowSpec:
    """A 1 min window of six 10 s buckets."""
    return WindowSpec(MINUTE, TEN_S, boundary)


def sample_state(spec: WindowSpec) -> Buckets:
    """5 at 2 s, 7 at 12 s, 3 at 55 s, 11 at 61 s."""
    buckets: Buckets = {}
    for occurred_ms, amount in [(2_000, 5), (12_000, 7), (55_000, 3), (61_000, 11)]:
        add(spec, buckets, occurred_ms, amount)
    return buckets


class TestWindowSpec:
    def test_defaults_to_include(self) -> None:
        assert WindowSpec(MINUTE, TEN_S).boundary == "include"

    @pytest.mark.parametrize(
        ("window_ms", "bucket_ms", "field"),
        [
            (MINUTE, 1_500, "bucket_ms"),  # not whole seconds
            (MINUTE, 0, "bucket_ms"),
            (MINUTE, 500, "bucket_ms"),
            (2 * MAX_BUCKET_MS, 2 * MAX_BUCKET_MS, "bucket_ms"),  # over 31 days
            (MINUTE, 7_000, "window_ms"),  # does not divide the window
            (5_000, TEN_S, "window_ms"),  # shorter than a bucket
            (0, TEN_S, "window_ms"),
        ],
    )
    def test_rejects_bad_sizes_naming_the_field(
        self, window_ms: int, bucket_ms: int, field: str
    ) -> None:
        with pytest.raises(ValueError, match=f"^{field}: "):
            WindowSpec(window_ms, bucket_ms)

    def test_rejects_non_int_sizes(self) -> None:
        with pytest.raises(ValueError, match="window_ms: must be an int"):
            WindowSpec(60.0, TEN_S)  # type: ignore[arg-type]

    def test_rejects_unknown_boundary(self) -> None:
        with pytest.raises(ValueError, match="boundary: 'partial'"):
            WindowSpec(MINUTE, TEN_S, "partial")  # type: ignore[arg-type]

    def test_accepts_the_largest_bucket(self) -> None:
        assert WindowSpec(MAX_BUCKET_MS, MAX_BUCKET_MS).bucket_ms == 31 * 86_400_000

    @pytest.mark.parametrize(
        ("t_ms", "start"),
        [(0, 0), (9_999, 0), (10_000, 10_000), (1_700_000_012_345, 1_700_000_010_000)],
    )
    def test_bucket_of_floors_to_the_bucket(self, t_ms: int, start: int) -> None:
        assert one_minute().bucket_of(t_ms) == start

    @pytest.mark.parametrize(
        ("t_ms", "first"),
        [
            (65_000, 0),  # bucket 0 still overlaps (5 s, 65 s]
            (69_998, 0),
            (69_999, 10_000),  # (9.999 s, 69.999 s] is exactly buckets 10 s..60 s
            (70_000, 10_000),
        ],
    )
    def test_first_live_bucket(self, t_ms: int, first: int) -> None:
        assert one_minute().first_live_bucket(t_ms) == first


class TestAdd:
    def test_aligns_and_accumulates(self) -> None:
        spec = one_minute()
        buckets: Buckets = {}
        assert add(spec, buckets, 12_345, 4) == 10_000
        assert add(spec, buckets, 19_999, 6) == 10_000
        assert add(spec, buckets, 20_000, 1) == 20_000
        assert buckets == {10_000: 10, 20_000: 1}

    def test_a_bucket_netting_to_zero_is_removed(self) -> None:
        spec = one_minute()
        buckets: Buckets = {10_000: 10}
        add(spec, buckets, 15_000, -10)
        assert buckets == {}

    def test_negative_adjustment_of_an_empty_bucket_is_kept(self) -> None:
        spec = one_minute()
        buckets: Buckets = {}
        add(spec, buckets, 15_000, -3)
        assert buckets == {10_000: -3}


class TestTotal:
    @pytest.mark.parametrize(
        ("boundary", "expected"),
        [
            ("include", 26),  # 5 + 7 + 3 + 11: bucket 0 overlaps (5 s, 65 s] on 4999 ms
            ("exclude", 21),
            ("prorate", 24),  # 21 + ceil(5 * 4999 / 10000) = 21 + 3
        ],
    )
    def test_boundary_modes(self, boundary: Boundary, expected: int) -> None:
        spec = one_minute(boundary)
        assert total(spec, sample_state(spec), 65_000) == expected

    @pytest.mark.parametrize("boundary", ["include", "exclude", "prorate"])
    def test_whole_buckets_at_the_last_millisecond_of_a_bucket(self, boundary: Boundary) -> None:
        spec = one_minute(boundary)
        # (9.999 s, 69.999 s]: buckets 10 s..60 s exactly, no boundary bucket.
        assert total(spec, sample_state(spec), 69_999) == 21
        assert boundary_usage(spec, sample_state(spec), 69_999) == 0

    @pytest.mark.parametrize(
        ("boundary", "expected"), [("include", 21), ("exclude", 14), ("prorate", 21)]
    )
    def test_next_bucket_starts_a_new_boundary(self, boundary: Boundary, expected: int) -> None:
        spec = one_minute(boundary)
        # At 70 s the boundary is bucket 10 s (7), overlapping on 9999 ms:
        # prorate ceil(7 * 9999 / 10000) = 7.
        assert total(spec, sample_state(spec), 70_000) == expected

    def test_future_buckets_count_at_once(self) -> None:
        # A bucket after now (a future-dated event, usage a width change moved to its old
        # bucket's end, a reservation held at a clock later than this one) counts now.
        spec = one_minute()
        state = sample_state(spec)
        before = total(spec, state, 65_000)
        add(spec, state, 75_000, 100)
        assert total(spec, state, 65_000) == before + 100
        assert total(spec, state, 70_000) == 121

    def test_head_bucket_counts_in_full(self) -> None:
        spec = one_minute("exclude")
        buckets: Buckets = {}
        add(spec, buckets, 61_500, 9)  # later than the query time, same bucket
        assert total(spec, buckets, 60_100) == 9

    def test_prorate_rounds_up_for_either_sign(self) -> None:
        spec = WindowSpec(TEN_S, TEN_S, "prorate")
        # At 10 s the boundary bucket 0 overlaps (0, 10 s] on 9999 ms.
        assert total(spec, {0: 1}, 10_000) == 1  # ceil(0.9999)
        assert total(spec, {0: -1}, 10_000) == 0  # ceil(-0.9999)
        assert total(spec, {0: 3}, 19_998) == 1  # ceil(3 * 1 / 10000)
        assert total(spec, {0: 3}, 19_999) == 0

    def test_single_bucket_window(self) -> None:
        spec = WindowSpec(TEN_S, TEN_S, "include")
        buckets = {0: 4, 10_000: 6}
        assert total(spec, buckets, 10_000) == 10
        assert total(spec, buckets, 19_999) == 6

    def test_empty(self) -> None:
        assert total(one_minute(), {}, 1_700_000_000_000) == 0

    def test_boundary_usage(self) -> None:
        spec = one_minute()
        assert boundary_usage(spec, sample_state(spec), 65_000) == 5
        assert boundary_usage(spec, sample_state(spec), 70_000) == 7


class TestPrune:
    def test_drops_only_what_cannot_count_again(self) -> None:
        spec = one_minute()
        state = sample_state(spec)
        assert prune(spec, state, 69_998) == 0
        assert prune(spec, state, 69_999) == 1
        assert state == {10_000: 7, 50_000: 3, 60_000: 11}

    def test_keeps_future_buckets(self) -> None:
        spec = one_minute()
        state = {200_000: 1, 0: 1}
        assert prune(spec, state, 100_000) == 1
        assert state == {200_000: 1}


class TestRetryAfter:
    @pytest.mark.parametrize(
        ("boundary", "fits_at_ms"),
        [
            # Limit 20, request 2: the total must come down to 18.
            ("include", 79_999),  # bucket 10 s (7) stops counting at its last overlapped ms
            ("exclude", 70_000),  # 14 from 70 s on
            # 14 + ceil(7 * k / 10000) <= 18 for k <= 5714 overlapped ms: r = 9999 - 5714.
            ("prorate", 74_285),
        ],
    )
    def test_exact_instant_per_boundary(self, boundary: Boundary, fits_at_ms: int) -> None:
        spec = one_minute(boundary)
        state = sample_state(spec)
        answer = retry_after(spec, state, 65_000, limit=20, amount=2)
        assert answer == RetryAfter(fits_at_ms, False)
        assert total(spec, state, fits_at_ms) + 2 <= 20
        assert total(spec, state, fits_at_ms - 1) + 2 > 20

    def test_fits_now(self) -> None:
        spec = one_minute()
        assert retry_after(spec, sample_state(spec), 65_000, limit=28, amount=2) == RetryAfter(
            65_000, False
        )

    def test_extra_is_held(self) -> None:
        spec = one_minute("exclude")
        answer = retry_after(spec, sample_state(spec), 65_000, limit=20, amount=2, extra=4)
        # 18 - 4 = 14 left for usage: 14 from 70 s on.
        assert answer == RetryAfter(70_000, False)

    def test_waits_for_everything_to_age_out(self) -> None:
        spec = one_minute("exclude")
        # Usage left after 70 s: 3 (50 s) + 11 (60 s); 0 from 120 s, when 60 s is the boundary.
        answer = retry_after(spec, sample_state(spec), 65_000, limit=5, amount=5)
        assert answer == RetryAfter(120_000, False)

    def test_never_fits_when_the_request_alone_exceeds_the_limit(self) -> None:
        spec = one_minute()
        assert retry_after(spec, {}, 0, limit=10, amount=11) == RetryAfter(None, True)

    def test_held_amount_that_never_ages_out(self) -> None:
        spec = one_minute()
        answer = retry_after(spec, sample_state(spec), 65_000, limit=10, amount=6, extra=5)
        assert answer == RetryAfter(None, False)

    def test_future_bucket_blocks_at_once(self) -> None:
        spec = WindowSpec(TEN_S, TEN_S, "exclude")
        # The future bucket at 20 s counts now, until it leaves the window at 30 s (the
        # excluded boundary bucket from then on).
        assert retry_after(spec, {20_000: 50}, 5_000, limit=10, amount=1) == RetryAfter(
            30_000, False
        )
        # From 20 s to 29.999 s it counts; at 30 s it is the (excluded) boundary bucket.
        assert retry_after(spec, {20_000: 50}, 20_000, limit=10, amount=1) == RetryAfter(
            30_000, False
        )

    def test_negative_boundary_bucket_at_the_last_millisecond(self) -> None:
        spec = WindowSpec(TEN_S, TEN_S, "include")
        buckets = {0: -5, 10_000: 12}
        # At 10 s the boundary -5 counts (total 7); at 19.999 s it no longer does (12),
        # and from 20 s the 12 is the boundary bucket, counted until 29.999 s.
        assert retry_after(spec, buckets, 10_000, limit=8, amount=1) == RetryAfter(10_000, False)
        assert retry_after(spec, buckets, 19_999, limit=8, amount=1) == RetryAfter(29_999, False)

    def test_rejects_negative_amounts(self) -> None:
        with pytest.raises(ValueError, match="must be >= 0"):
            retry_after(one_minute(), {}, 0, limit=1, amount=-1)
        with pytest.raises(ValueError, match="must be >= 0"):
            retry_after(one_minute(), {}, 0, limit=1, amount=0, extra=-1)

    def test_dense_day_at_epoch_scale(self) -> None:
        spec = WindowSpec(86_400_000, MINUTE, "prorate")
        now = 1_700_000_000_000  # 20 s into its minute
        buckets: Buckets = {}
        for minute in range(1441):
            add(spec, buckets, now - minute * MINUTE, 1_000)
        # 1440 whole minutes plus the boundary minute overlapping on 39,999 ms.
        assert total(spec, buckets, now) == 1_440_000 + 667  # ceil(1000 * 39999 / 60000)
        answer = retry_after(spec, buckets, now, limit=1_440_000, amount=1_000)
        # Next minute: 1439 whole minutes + the boundary's share must reach 0: its last ms.
        assert answer == RetryAfter(now - 20_000 + 2 * MINUTE - 1, False)
