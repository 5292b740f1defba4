"""The burn-rate forecast against a brute-force projection (an oracle that never imports it).

The oracle follows the documented rule (``schemas/forecast.py``'s docstring) with the
reference window total of ``tests/schemas/reference.py``: the recent usage over the last
10% of the window (whole buckets, at least one), spread over the time those buckets have
covered, projected millisecond by millisecond over one window.
"""

from __future__ import annotations

import math
import random

import pytest

from spendgate.schemas.forecast import forecast
from spendgate.schemas.windows import WindowSpec
from tests.fixtures.seeds import RUN_SEED
from tests.schemas import reference

WINDOW_MS, BUCKET_MS = 20_000, 1_000

Event = tuple[int, int]


def oracle(boundary: str, events: list[Event], t_ms: int, limit: int) -> int | None:
    """The first ms offset at which the projection reaches the limit, by brute force."""
    lookback = max(1, math.ceil(WINDOW_MS / BUCKET_MS / 10))
    head = t_ms - t_ms % BUCKET_MS
    oldest = head - (lookback - 1) * BUCKET_MS
    recent = sum(a for at, a in events if oldest <= at - at % BUCKET_MS <= head)
    elapsed = (lookback - 1) * BUCKET_MS + t_ms % BUCKET_MS + 1
    sums = list(reference.buckets_of(BUCKET_MS, events).items())
    for d in range(WINDOW_MS + 1):
        used = window_total(boundary, sums, t_ms + d)
        grown = recent * min(d, WINDOW_MS) // elapsed if recent > 0 else 0
        if used + grown >= limit:
            return d
        if recent <= 0 and d == 0:
            return None
    return None


def window_total(boundary: str, sums: list[tuple[int, int]], t_ms: int) -> int:
    """``reference.reference_total`` on bucket sums (each bucket's overlap with the window)."""
    first_ms = t_ms - WINDOW_MS + 1
    result = 0
    for start, amount in sums:
        low, high = max(start, first_ms), min(start + BUCKET_MS - 1, t_ms)
        if start > t_ms or low > high:
            continue
        if start >= first_ms or boundary == "include":
            result += amount
        elif boundary == "prorate":
            result += -((-amount * (high - low + 1)) // BUCKET_MS)
    return result


def history(shape: str, rng: random.Random, t_ms: int) -> list[Event]:
    """One event per ~second over the last window, its size following ``shape``."""
    events: list[Event] = []
    steps = WINDOW_MS // 1000
    for i in range(steps):
        at = t_ms - WINDOW_MS + 1 + i * 1000 + rng.randrange(1000)
        if at > t_ms:
            continue
        size = {"constant": 10, "rising": 1 + i, "falling": 1 + steps - i}[shape]
        events.append((at, size + rng.randrange(3)))
    return events


class TestForecastAgainstBruteForce:
    @pytest.mark.parametrize("boundary", ["include", "exclude", "prorate"])
    @pytest.mark.parametrize("shape", ["constant", "rising", "falling"])
    def test_matches_the_projection(self, boundary: str, shape: str) -> None:
        rng = random.Random(f"{RUN_SEED}-{boundary}-{shape}")
        spec = WindowSpec(WINDOW_MS, BUCKET_MS, boundary)  # type: ignore[arg-type]
        outcomes = []
        for _ in range(3):
            t_ms = 1_700_000_000_000 + rng.randrange(10**6)
            events = history(shape, rng, t_ms)
            buckets = reference.buckets_of(BUCKET_MS, events)
            now = reference.reference_total(WINDOW_MS, BUCKET_MS, boundary, events, t_ms)
            for limit in (max(1, now // 2), now + 1, now + rng.randrange(1, 200), now * 3 + 50):
                got = forecast(spec, buckets, t_ms, limit=limit).exhausts_in_ms
                want = oracle(boundary, events, t_ms, limit)
                assert got == want, (limit, t_ms, events)
                # Looking only 7 s ahead finds the same instant when it lies within them.
                near = forecast(spec, buckets, t_ms, limit=limit, horizon_ms=7_000)
                assert near.exhausts_in_ms == (want if want is not None and want <= 7_000 else None)
                outcomes.append(want)
        assert 0 in outcomes  # already exhausted
        if shape != "falling":  # a falling rate may free more than it spends: never heads
            assert any(o is not None and o > 0 for o in outcomes)

    def test_a_falling_rate_that_frees_more_than_it_spends_never_exhausts(self) -> None:
        spec = WindowSpec(WINDOW_MS, BUCKET_MS, "include")
        t_ms = 1_700_000_010_999
        # 900 spent long ago in the window, 1 per second lately.
        events = [(t_ms - 17_000, 900)] + [(t_ms - k * 1000, 1) for k in range(3)]
        buckets = reference.buckets_of(BUCKET_MS, events)
        result = forecast(spec, buckets, t_ms, limit=1000)
        assert result.exhausts_in_ms is None
        assert oracle("include", events, t_ms, 1000) is None

    def test_no_recent_usage_is_not_heading_anywhere(self) -> None:
        spec = WindowSpec(WINDOW_MS, BUCKET_MS, "include")
        t_ms = 1_700_000_010_000
        buckets = {t_ms - t_ms % BUCKET_MS - 20_000: 50}
        result = forecast(spec, buckets, t_ms, limit=100)
        assert result.rate.recent == 0
        assert result.exhausts_in_ms is None and result.exhausts_in_seconds is None

    def test_seconds_round_up(self) -> None:
        spec = WindowSpec(WINDOW_MS, BUCKET_MS, "exclude")
        t_ms = 1_700_000_000_999  # the head bucket is complete: elapsed = 3 whole buckets
        buckets = {t_ms - 999 - k * 1000: 10 for k in range(3)}  # 30 over 3 s: 10 per s
        result = forecast(spec, buckets, t_ms, limit=36)
        assert result.rate.per_second == 10.0
        # 30 now, none of it ages out for 17 s: 6 more at 10 per second take 600 ms.
        assert result.exhausts_in_ms == 600
        assert result.exhausts_in_seconds == 1
