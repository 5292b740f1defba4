"""Property tests: the token-bucket engine against a brute-force bucket.

The oracle (:class:`Bucket`) never calls the engine: it holds the tokens as an exact
fraction, refills them by ``elapsed * rate / per`` capped at ``capacity``, and finds a
wait by trying every millisecond in turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.burst import (
    BurstSpec,
    BurstState,
    check,
    decode_state,
    encode_state,
    full_after_ms,
    level_at,
    take,
)


@dataclass
class Bucket:
    """A token bucket, the obvious way."""

    rate: int
    per_ms: int
    capacity: int
    tokens: Fraction
    at_ms: int

    def at(self, now_ms: int) -> Fraction:
        gained = Fraction(max(0, now_ms - self.at_ms) * self.rate, self.per_ms)
        return min(Fraction(self.capacity), self.tokens + gained)

    def wait_ms(self, now_ms: int, amount: int) -> int | None:
        """The first whole millisecond from now at which ``amount`` tokens are there."""
        if amount > self.capacity:
            return None
        wait = 0
        while self.at(now_ms + wait) < amount:
            wait += 1
        return wait

    def spend(self, now_ms: int, amount: int) -> None:
        self.tokens = max(Fraction(0), self.at(now_ms) - min(amount, self.capacity))
        self.at_ms = now_ms


specs = st.builds(
    BurstSpec,
    rate=st.integers(1, 7),
    per_ms=st.integers(1, 60),
    capacity=st.integers(1, 12),
)
#: (ms since the previous step, amount asked, taken even when it does not fit: observe)
steps = st.lists(
    st.tuples(st.integers(0, 400), st.integers(0, 14), st.booleans()), min_size=1, max_size=25
)


class TestBurstEngine:
    @given(spec=specs, start=st.integers(0, 2**41), ops=steps)
    def test_the_engine_is_the_brute_force_bucket(
        self, spec: BurstSpec, start: int, ops: list[tuple[int, int, bool]]
    ) -> None:
        oracle = Bucket(spec.rate, spec.per_ms, spec.capacity, Fraction(spec.capacity), start)
        stored: str | None = None  # as in Redis: expires when the bucket would be full
        expires_at: int | None = None
        now = start
        for dt, amount, observe in ops:
            now += dt
            if expires_at is not None and now >= expires_at:
                stored, expires_at = None, None
            state = decode_state(stored)
            got = check(spec, state, now, amount)
            want_wait = oracle.wait_ms(now, amount)
            assert got.never_fits == (want_wait is None)
            assert Fraction(got.level, spec.per_ms) == oracle.at(now)
            assert got.tokens(spec) == int(oracle.at(now))
            assert got.fits == (want_wait == 0)
            if want_wait is not None and not got.fits:
                assert got.wait_ms == want_wait
            if (got.fits or observe) and amount > 0:
                after = take(spec, got.level, now, amount)
                oracle.spend(now, amount)
                assert Fraction(after.level, spec.per_ms) == oracle.tokens
                stored = encode_state(after)
                expires_at = now + full_after_ms(spec, after.level)

    @given(spec=specs, level_tokens=st.integers(0, 12), at=st.integers(0, 2**41))
    def test_a_state_that_expired_is_a_full_bucket(
        self, spec: BurstSpec, level_tokens: int, at: int
    ) -> None:
        level = min(level_tokens, spec.capacity) * spec.per_ms
        ttl = full_after_ms(spec, level)
        state = BurstState(level, at)
        assert level_at(spec, state, at + ttl) == spec.full
        if ttl > 0:
            assert level_at(spec, state, at + ttl - 1) < spec.full

    def test_a_clock_that_went_back_refills_nothing(self) -> None:
        spec = BurstSpec(rate=1, per_ms=1000, capacity=10)
        assert level_at(spec, BurstState(3000, 50_000), 40_000) == 3000

    def test_exact_at_the_largest_allowed_scale(self) -> None:
        spec = BurstSpec(rate=1, per_ms=86_400_000, capacity=(2**53 - 1) // 86_400_000)
        got = check(spec, BurstState(0, 0), 1, spec.capacity)
        assert not got.fits
        assert got.wait_ms == spec.full - 1
