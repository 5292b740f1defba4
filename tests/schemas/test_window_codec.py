"""Tests of the compact window-state layout."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.window_codec import (
    HEADER_SIZE,
    KIND_DENSE,
    KIND_SPARSE,
    MAX_SAFE_AMOUNT,
    SPARSE_MAX_BYTES,
    DecodedState,
    decode,
    encode,
)

# Example counts come from the hypothesis profiles in tests/conftest.py (ci: 2000).

MINUTE = 60_000
NOW = 1_700_000_040_000  # a whole minute


class TestLayout:
    def test_empty_is_a_bare_header(self) -> None:
        data = encode({}, MINUTE)
        assert data == struct.pack("<BBIqIqq", 2, KIND_SPARSE, MINUTE, 0, 0, -1, 0)
        assert len(data) == HEADER_SIZE == 34
        assert decode(data) == DecodedState(MINUTE, {})

    def test_sparse_bytes_hold_prefix_sums_and_the_newest_negative_bucket(self) -> None:
        data = encode({NOW: 5, NOW + 10 * MINUTE: -2, NOW + 12 * MINUTE: 4}, MINUTE)
        assert data == (
            struct.pack("<BBIqIqq", 2, KIND_SPARSE, MINUTE, NOW, 3, NOW + 10 * MINUTE, 7)
            + struct.pack("<Iq", 0, 5)
            + struct.pack("<Iq", 10, 3)
            + struct.pack("<Iq", 12, 7)
        )

    def test_dense_bytes_hold_prefix_sums_an_empty_slot_repeats_the_one_before(self) -> None:
        data = encode({NOW + i * MINUTE: 1 for i in (0, 1, 2, 4)}, MINUTE)
        # 5 slots (the empty 4th repeats the 3rd's prefix), then the summary: 1 entry.
        assert data == struct.pack(
            "<BBIqIqq6q", 2, KIND_DENSE, MINUTE, NOW, 5, -1, 4, 1, 2, 3, 3, 4, 4
        )

    def test_the_dense_summary_holds_every_32nd_prefix_and_the_last(self) -> None:
        data = encode({NOW + i * MINUTE: 2 for i in range(70)}, MINUTE)
        assert data[1] == KIND_DENSE and len(data) == HEADER_SIZE + 8 * (70 + 3)
        assert struct.unpack_from("<3q", data, HEADER_SIZE + 8 * 70) == (64, 128, 140)
        corrupt = data[:-8] + struct.pack("<q", 139)
        with pytest.raises(ValueError, match="summary"):
            decode(corrupt)

    def test_a_prefix_of_zero_is_a_bucket_not_a_gap(self) -> None:
        buckets = {NOW: 5, NOW + MINUTE: -5, NOW + 2 * MINUTE: 1}
        data = encode(buckets, MINUTE)
        assert data[1] == KIND_DENSE
        assert decode(data).buckets == buckets

    def test_version_1_is_still_read(self) -> None:
        sparse = (
            struct.pack("<BBIqI", 1, KIND_SPARSE, MINUTE, NOW, 2)
            + struct.pack("<Iq", 0, 5)
            + struct.pack("<Iq", 10, -2)
        )
        assert decode(sparse) == DecodedState(MINUTE, {NOW: 5, NOW + 10 * MINUTE: -2})
        dense = struct.pack("<BBIqI3q", 1, KIND_DENSE, MINUTE, NOW, 3, 5, 0, 7)
        assert decode(dense) == DecodedState(MINUTE, {NOW: 5, NOW + 2 * MINUTE: 7})
        assert encode({NOW: 5, NOW + 10 * MINUTE: -2}, MINUTE, version=1) == sparse
        assert sparse[0] == 1 and encode({}, MINUTE)[0] == 2

    def test_zero_amounts_are_skipped(self) -> None:
        assert decode(encode({NOW: 0, NOW + MINUTE: 3}, MINUTE)).buckets == {NOW + MINUTE: 3}


class TestSize:
    def test_dense_day_of_minutes(self) -> None:
        buckets = {NOW + i * MINUTE: 1_000_000 + i for i in range(1440)}
        data = encode(buckets, MINUTE)
        assert data[1] == KIND_DENSE
        assert len(data) == 11_914 <= 16 * 1024  # 1440 slots, 45 summary entries
        assert decode(data).buckets == buckets

    def test_sparse_sixty_buckets_across_a_day(self) -> None:
        buckets = {NOW + i * 24 * MINUTE: 123_456_789 for i in range(60)}
        data = encode(buckets, MINUTE)
        assert data[1] == KIND_SPARSE
        assert len(data) == 754 <= 2 * 1024
        assert decode(data).buckets == buckets

    @pytest.mark.parametrize("count", [1, 2, 10, 60, 500, 1441])
    def test_grows_with_non_empty_buckets_not_with_span(self, count: int) -> None:
        spread = {NOW + i * 1440 * MINUTE // count: 1 for i in range(count)}
        spread = {start - start % MINUTE: amount for start, amount in spread.items()}
        data = encode(spread, MINUTE)
        if 12 * count <= SPARSE_MAX_BYTES:
            assert len(data) <= HEADER_SIZE + 12 * count
        else:  # never a sparse body over 2 KB: dense, its size bounded by the span
            assert data[1] == KIND_DENSE and len(data) <= HEADER_SIZE + 8 * (1441 + 46)


class TestValidation:
    def test_amount_over_two_to_the_53(self) -> None:
        with pytest.raises(ValueError, match="2\\*\\*53"):
            encode({NOW: MAX_SAFE_AMOUNT + 1}, MINUTE)

    def test_sum_over_two_to_the_53(self) -> None:
        with pytest.raises(ValueError, match="2\\*\\*53"):
            encode(
                {NOW: MAX_SAFE_AMOUNT // 2 + 1, NOW + MINUTE: -(MAX_SAFE_AMOUNT // 2 + 1)}, MINUTE
            )

    def test_largest_safe_amount(self) -> None:
        buckets = {NOW: -MAX_SAFE_AMOUNT}
        assert decode(encode(buckets, MINUTE)).buckets == buckets

    @pytest.mark.parametrize("start", [NOW + 1, -MINUTE])
    def test_misaligned_or_negative_start(self, start: int) -> None:
        with pytest.raises(ValueError, match="non-negative multiple of bucket_ms"):
            encode({start: 1}, MINUTE)

    @pytest.mark.parametrize("bucket_ms", [0, 2**32])
    def test_bucket_ms_must_fit_u32(self, bucket_ms: int) -> None:
        with pytest.raises(ValueError, match="bucket_ms"):
            encode({}, bucket_ms)

    def test_span_too_wide(self) -> None:
        with pytest.raises(ValueError, match="too wide"):
            encode({0: 1, 2**32 * 1000: 1}, 1000)

    @pytest.mark.parametrize(
        ("data", "message"),
        [
            (b"", "unknown format version 0"),
            (b"\x02", "shorter than the header"),
            (struct.pack("<BBIqI", 3, 0, MINUTE, 0, 0), "unknown format version 3"),
            (struct.pack("<BBIqIq", 2, 0, MINUTE, 0, 0, -1), "shorter than the header"),
            (struct.pack("<BBIqI", 1, 7, MINUTE, 0, 0), "unknown kind 7"),
            (struct.pack("<BBIqIqq", 2, 7, MINUTE, 0, 0, -1, 0), "unknown kind 7"),
            (struct.pack("<BBIqI", 1, 0, 0, 0, 0), "bucket_ms is 0"),
            (struct.pack("<BBIqI", 1, 0, MINUTE, 0, 1), "sparse body of 0 bytes"),
            (struct.pack("<BBIqI", 1, 1, MINUTE, 0, 2) + b"\0" * 8, "dense body of 8 bytes"),
            (struct.pack("<BBIqI", 1, 0, MINUTE, 0, 0) + b"\0", "sparse body of 1 bytes"),
            (
                struct.pack("<BBIqIIqIq", 1, 0, MINUTE, 0, 2, 3, 1, 3, 1),
                "offsets must increase",
            ),
            (struct.pack("<BBIqIIq", 1, 0, MINUTE, 0, 1, 3, 0), "amount is zero"),
            # Version 2: a repeated prefix is a zero amount; neg_ms must be the newest one.
            (struct.pack("<BBIqIqqIqIq", 2, 0, MINUTE, 0, 2, -1, 4, 0, 4, 1, 4), "amount is zero"),
            (struct.pack("<BBIqIqqIqIq", 2, 0, MINUTE, 0, 2, -1, 3, 0, 4, 1, 3), "neg_ms -1"),
            (struct.pack("<BBIqIqqIq", 2, 0, MINUTE, 0, 1, 0, 4, 0, 4), "neg_ms 0"),
            (struct.pack("<BBIqIqqIq", 2, 0, MINUTE, 0, 1, -1, 5, 0, 4), "sum 5"),
        ],
    )
    def test_decode_rejects_corrupt_values(self, data: bytes, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            decode(data)


_BUCKET_MS = st.sampled_from([1_000, 5_000, MINUTE, 3_600_000, 86_400_000])
_AMOUNTS = st.integers(-(2**40), 2**40).filter(bool)


class TestRoundTrip:
    @given(
        _BUCKET_MS,
        st.integers(0, 2**41),
        st.dictionaries(st.integers(0, 3000), _AMOUNTS, max_size=80),
    )
    def test_round_trip(self, bucket_ms: int, origin_ms: int, slots: dict[int, int]) -> None:
        base = origin_ms - origin_ms % bucket_ms
        buckets = {base + slot * bucket_ms: amount for slot, amount in slots.items()}
        data = encode(buckets, bucket_ms)
        assert decode(data) == DecodedState(bucket_ms, buckets)
        assert decode(encode(buckets, bucket_ms, version=1)) == DecodedState(bucket_ms, buckets)
        # Never bigger than the sparse form, unless that is over 2 KB (then dense).
        if 12 * len(buckets) <= SPARSE_MAX_BYTES:
            assert len(data) <= HEADER_SIZE + 12 * len(buckets)
        else:
            assert data[1] == KIND_DENSE

    @given(st.integers(1, 1440), st.integers(0, 2**32))
    def test_never_over_a_dense_full_day(self, count: int, seed: int) -> None:
        rng = random.Random(seed)  # cheaper than drawing up to 1440 slots through hypothesis
        slots = rng.sample(range(1440), count)
        buckets = {NOW + slot * MINUTE: rng.randint(1, 2**40) for slot in slots}
        data = encode(buckets, MINUTE)
        assert len(data) <= HEADER_SIZE + 8 * (1440 + 45)
        assert decode(data).buckets == buckets
