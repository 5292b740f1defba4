"""Burn-rate forecast: when a key's window reaches its limit if its recent rate goes on.

Pure, time is an argument (all times integer ms since the epoch), like ``schemas.windows``.

* **Burn rate.** The recent usage is the sum of the key's buckets in the last
  ``ceil(window / bucket * FRACTION)`` buckets (at least one) up to the bucket holding
  ``t_ms`` — by default the last 10% of the window; for a 24 h window of 1 m buckets, the
  last 144 minutes. It is spread over the time those buckets have covered so far,
  ``elapsed_ms = (n - 1) * bucket_ms + t_ms % bucket_ms + 1`` (the head bucket only counts
  the part that has passed). Buckets dated after ``t_ms`` do not count in the rate.
* **Projection.** At ``t_ms + d`` (``0 <= d <= window_ms``) the projected usage is the
  window total of the buckets already there, aged as the window engine ages them
  (``windows.total`` at ``t_ms + d``: what ages out meanwhile leaves, boundary policy
  included), plus the new usage the rate brings, ``recent * d // elapsed_ms``. The
  forecast is the smallest such ``d`` (integer ms) at which the projection reaches the
  limit. Looking further than one window adds nothing: after a window only the rate's own
  usage is left, and it no longer grows.
* **Not heading for the limit**: ``None`` — no recent usage (or a net refund), or the
  projection stays under the limit for a whole window. A key already at or over its limit
  is exhausted now: ``0``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from spendgate.schemas.windows import WindowSpec, _boundary_part, total

__all__ = ["FRACTION", "BurnRate", "Forecast", "burn_rate", "exhausts_in_ms", "forecast"]

#: The share of the window the burn rate looks back over.
FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class BurnRate:
    """Usage ``recent`` over the last ``elapsed_ms`` (a rate of ``recent / elapsed_ms``)."""

    recent: int
    elapsed_ms: int

    @property
    def per_second(self) -> float:
        """The rate in units per second."""
        return self.recent * 1000 / self.elapsed_ms


@dataclass(frozen=True, slots=True)
class Forecast:
    """A key's burn rate and when it exhausts at that rate (``None``: not heading there)."""

    rate: BurnRate
    exhausts_in_ms: int | None

    @property
    def exhausts_in_seconds(self) -> int | None:
        """:attr:`exhausts_in_ms` in whole seconds, rounded up (``None`` stays ``None``)."""
        return None if self.exhausts_in_ms is None else math.ceil(self.exhausts_in_ms / 1000)


def lookback_buckets(spec: WindowSpec, fraction: float = FRACTION) -> int:
    """How many buckets the burn rate looks back over (at least one)."""
    return max(1, math.ceil(spec.window_ms // spec.bucket_ms * fraction))


def burn_rate(
    spec: WindowSpec, buckets: Mapping[int, int], t_ms: int, fraction: float = FRACTION
) -> BurnRate:
    """The recent usage at ``t_ms`` and the time it was spent over (module docstring)."""
    b = spec.bucket_ms
    n = lookback_buckets(spec, fraction)
    head = t_ms - t_ms % b
    oldest = head - (n - 1) * b
    if n * 4 < len(buckets):
        recent = sum(buckets.get(oldest + k * b, 0) for k in range(n))
    else:
        recent = sum(v for s, v in buckets.items() if oldest <= s <= head)
    return BurnRate(recent, (n - 1) * b + t_ms % b + 1)


def exhausts_in_ms(
    spec: WindowSpec,
    buckets: Mapping[int, int],
    t_ms: int,
    *,
    limit: int,
    rate: BurnRate,
    horizon_ms: int | None = None,
) -> int | None:
    """The smallest ``d`` in ``[0, min(horizon_ms, window_ms)]`` whose projection reaches
    ``limit`` (None: none does).

    The window total is piecewise in time: it changes only when a bucket enters (its
    start), becomes the boundary bucket (start + window), or leaves (start + window +
    bucket; ``include`` drops it one millisecond earlier). A sweep over those instants
    keeps the full buckets' sum and the boundary bucket; between two of them the total is
    constant (``prorate``: it shrinks within the boundary period, scanned per ms only when
    the period could hold the answer) and the projected new usage only grows, so each
    piece is solved in O(1). Only the buckets that can age out within the horizon are
    visited (O(horizon / bucket) lookups) unless some bucket lies after ``t_ms``; and when
    the usage now plus all the rate can add within the horizon stays under the limit,
    nothing is visited at all.
    """
    used = total(spec, buckets, t_ms)
    if used >= limit:
        return 0
    if rate.recent <= 0 or not buckets:
        return None
    w, b = spec.window_ms, spec.bucket_ms
    reach = w if horizon_ms is None else min(w, horizon_ms)
    end = t_ms + reach
    recent, elapsed = rate.recent, rate.elapsed_ms
    future = max(buckets) > t_ms
    if not future and used + recent * reach // elapsed < limit:
        return None  # ageing only lowers the total: the rate alone cannot get there
    head = t_ms - t_ms % b
    edge_start = head - w
    edge = buckets.get(edge_start, 0)
    full = used - _boundary_part(spec.boundary, edge, b - 1 - t_ms % b, b)
    if not edge:
        edge_start = -1
    # What changes when, after t_ms: a bucket enters (+full), becomes the boundary
    # bucket (-full, edge), leaves (edge gone); include drops its edge one ms early.
    changes: dict[int, list[tuple[int, int]]] = {}

    def note(s: int) -> None:
        for cut, what in ((s, 0), (s + w, 1), (s + w + b, 2)):
            if t_ms < cut <= end:
                changes.setdefault(cut, []).append((what, s))

    if future:
        for s in buckets:
            note(s)
    else:
        # Only buckets that become the boundary, or leave, within the horizon.
        s = head - w
        while s + w <= end:
            if s in buckets:
                note(s)
            s += b
    cuts = set(changes)
    cuts.update(c + b - 1 for c in list(changes) if t_ms < c + b - 1 <= end)
    cuts.add(head + b - 1)
    ordered = sorted(c for c in cuts if t_ms < c <= end)
    ordered.append(end + 1)
    lo = t_ms
    for hi in ordered:
        found = _solve_piece(spec, lo, hi, t_ms, full, edge, limit, recent, elapsed)
        if found is not None:
            return found
        for what, s in changes.get(hi, ()):
            v = buckets[s]
            if what == 0:
                full += v
            elif what == 1:
                full -= v
                edge_start, edge = s, v
            elif edge_start == s:
                edge_start, edge = -1, 0
        lo = hi
    return None


def _solve_piece(
    spec: WindowSpec,
    lo: int,
    hi: int,
    t_ms: int,
    full: int,
    edge: int,
    limit: int,
    recent: int,
    elapsed: int,
) -> int | None:
    """The first ``d`` with ``lo <= t_ms + d < hi`` whose projection reaches ``limit``,
    while the full buckets sum to ``full`` and the boundary bucket holds ``edge``."""
    if lo >= hi:
        return None
    w, b, boundary = spec.window_ms, spec.bucket_ms, spec.boundary
    first = _boundary_part(boundary, edge, b - 1 - lo % b, b)
    if boundary == "prorate" and edge:
        last = _boundary_part(boundary, edge, b - 1 - (hi - 1) % b, b)
        if first != last:
            grown_max = recent * min(hi - 1 - t_ms, w) // elapsed
            if full + max(first, last) + grown_max < limit:
                return None  # even its largest total with its largest growth falls short
            for at in range(lo, hi):
                part = _boundary_part(boundary, edge, b - 1 - at % b, b)
                if full + part + recent * min(at - t_ms, w) // elapsed >= limit:
                    return at - t_ms
            return None
    have = full + first
    need = limit - have
    d = 0 if need <= 0 else -((-need * elapsed) // recent)
    d = max(d, lo - t_ms)
    if d <= min(hi - 1 - t_ms, w) and have + recent * min(d, w) // elapsed >= limit:
        return d
    return None


def forecast(
    spec: WindowSpec,
    buckets: Mapping[int, int],
    t_ms: int,
    *,
    limit: int,
    fraction: float = FRACTION,
    horizon_ms: int | None = None,
) -> Forecast:
    """The burn rate at ``t_ms`` and when the key exhausts if it goes on.

    Args:
        spec: the policy's window.
        buckets: the key's buckets (absorbed and pending combined, as admission sees them).
        t_ms: the instant of the forecast.
        limit: the policy's limit.
        fraction: the share of the window the burn rate looks back over.
        horizon_ms: look no further than this (default: one window); a later exhaustion
            is reported as ``None``.
    """
    rate = burn_rate(spec, buckets, t_ms, fraction)
    ahead = exhausts_in_ms(spec, buckets, t_ms, limit=limit, rate=rate, horizon_ms=horizon_ms)
    return Forecast(rate, ahead)
