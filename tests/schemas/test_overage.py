"""cap_next's ratio and its decay, against arithmetic done here with fractions."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.overage import (
    MAX_RATIO_MILLI,
    OverageMark,
    factor_milli,
    ratio_milli,
    scaled,
)


class TestRatio:
    @given(st.integers(1, 10**9), st.integers(0, 10**10))
    def test_is_the_rounded_up_ratio_within_bounds(self, reserved: int, actual: int) -> None:
        exact = math.ceil(Fraction(actual * 1000, reserved))
        assert ratio_milli(reserved, actual) == max(1000, min(MAX_RATIO_MILLI, exact))

    def test_nothing_reserved(self) -> None:
        assert ratio_milli(0, 5) == MAX_RATIO_MILLI and ratio_milli(0, 0) == 1000


class TestDecay:
    @given(st.integers(1001, MAX_RATIO_MILLI), st.integers(-(10**6), 10**7), st.integers(1, 10**7))
    def test_linear_back_to_one_over_a_window(self, ratio: int, age: int, window: int) -> None:
        mark = OverageMark(ratio, 10**9)
        got = factor_milli(mark, 10**9 + age, window)
        left = max(0, window - max(0, age))
        assert got == 1000 + math.ceil(Fraction((ratio - 1000) * left, window))
        assert 1000 <= got <= ratio

    def test_examples(self) -> None:
        mark = OverageMark(3000, 0)
        assert [factor_milli(mark, t, 60_000) for t in (0, 30_000, 60_000)] == [3000, 2000, 1000]
        assert factor_milli(None, 0, 60_000) == 1000
        assert OverageMark.decode(mark.encode()) == mark
        assert OverageMark.decode(b"junk") is None

    def test_scaled_rounds_up(self) -> None:
        assert scaled({"output_tokens": 100, "requests": 1}, 1500) == {
            "output_tokens": 150,
            "requests": 1,
        }
