"""Brute-force oracles of the window semantics, written from DESIGN.md, not from the engine.

Nothing here imports ``schemas.windows`` (the engine these oracles judge) or the Lua twin:
a bucket is ``ms - ms % bucket_ms``, a window is ``(t - window, t]``, and the partial
oldest bucket is counted per ``boundary`` by exact rational arithmetic.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from fractions import Fraction

Event = tuple[int, int]  # (occurred_ms, signed amount)


def bucket_start(ms: int, bucket_ms: int) -> int:
    """The start of the bucket holding ``ms`` (buckets aligned to the epoch)."""
    return ms - ms % bucket_ms


def buckets_of(bucket_ms: int, events: Iterable[Event]) -> dict[int, int]:
    """Bucket start -> summed amount (empty sums dropped)."""
    out: defaultdict[int, int] = defaultdict(int)
    for occurred, amount in events:
        out[bucket_start(occurred, bucket_ms)] += amount
    return {start: amount for start, amount in out.items() if amount}


def exact_total(window_ms: int, events: Iterable[Event], t_ms: int) -> int:
    """The exact trailing total: events with ``occurred_ms`` in ``(t - window, t]``."""
    return sum(a for occurred, a in events if t_ms - window_ms < occurred <= t_ms)


def reference_total(
    window_ms: int, bucket_ms: int, boundary: str, events: Iterable[Event], t_ms: int
) -> int:
    """The bucketed total: each bucket's overlap with the window, the head counted whole,
    and anything recorded after ``t_ms`` counted whole at once (DESIGN: what is recorded
    counts; a bucket after now holds future-dated usage, usage a width change moved to its
    old bucket's end, or a reservation held at a clock later than this one)."""
    first_ms = t_ms - window_ms + 1  # the oldest millisecond inside the window
    result = 0
    for start, amount in buckets_of(bucket_ms, events).items():
        if start > t_ms:
            result += amount  # recorded after now: counts at once
            continue
        low, high = max(start, first_ms), min(start + bucket_ms - 1, t_ms)
        if low > high:
            continue  # entirely before the window
        if start >= first_ms or boundary == "include":
            result += amount
        elif boundary == "prorate":
            result += math.ceil(Fraction(amount * (high - low + 1), bucket_ms))
        elif boundary != "exclude":
            raise ValueError(f"unknown boundary {boundary!r}")
    return result


def reference_boundary_usage(
    window_ms: int, bucket_ms: int, events: Iterable[Event], t_ms: int
) -> int:
    """Usage recorded in the bucket that straddles the window's start (0 when none does)."""
    first_ms = t_ms - window_ms + 1
    start = bucket_start(first_ms, bucket_ms)
    if start == first_ms:
        return 0
    return sum(a for occurred, a in events if start <= occurred < start + bucket_ms)


def period_ends(bucket_ms: int, start_ms: int, end_ms: int) -> list[int]:
    """Both ends of every head-bucket period clipped to ``[start_ms, end_ms]``.

    Within one period only the partial oldest bucket's share moves, monotonically, so the
    total there is monotone (or two-valued at its last millisecond): testing the ends of
    every period decides whether any instant in it fits.
    """
    ends: list[int] = []
    period = bucket_start(start_ms, bucket_ms)
    while period <= end_ms:
        ends += [max(start_ms, period), min(end_ms, period + bucket_ms - 1)]
        period += bucket_ms
    return ends
