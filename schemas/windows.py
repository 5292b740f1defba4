"""The pure rolling-window engine: bucket alignment, boundary policy, totals, retry-after.

Model (all times are integer milliseconds since the Unix epoch; nothing here reads a
clock, time is always an argument):

* A budget key's state is a ``Buckets`` map: bucket start (ms) -> net signed amount.
  A bucket covers ``[start, start + bucket_ms)``; starts are multiples of
  ``bucket_ms`` (``start = occurred_ms - occurred_ms % bucket_ms``). Buckets whose net
  amount is 0 are not stored.
* The exact trailing total at ``t_ms`` sums the events with ``occurred_ms`` in
  ``(t_ms - window_ms, t_ms]``. Let ``r = t_ms % bucket_ms`` and ``head = t_ms - r``
  (the bucket holding ``t_ms``). The bucketed total counts:

  - every bucket with start in ``[head - window_ms + bucket_ms, head]`` in full;
  - the *boundary bucket* ``head - window_ms``, which overlaps the window on
    ``overlap_ms = bucket_ms - 1 - r`` of its milliseconds (none when
    ``r == bucket_ms - 1``; the window then is exactly ``window_ms / bucket_ms`` whole
    buckets), according to ``boundary``: ``include`` counts it in full when
    ``overlap_ms > 0`` (never under-counts), ``exclude`` drops it (never over-counts),
    ``prorate`` counts ``ceil(amount * overlap_ms / bucket_ms)``. Rounding up keeps the
    prorated part between the ``exclude`` (0) and ``include`` (amount) values for either
    sign, and errs on the conservative side for usage;
  - every bucket that starts after ``t_ms`` in full, as soon as it is recorded.

* Recorded-is-counted rule: a bucket cannot be split, so the head bucket is counted in
  full, including any event recorded in it with ``occurred_ms`` later than ``t_ms``; and a
  bucket after the head counts now too, until it leaves the window by its own start. Such
  buckets hold future-dated events (clock skew up to the allowed future skew), amounts a
  policy whose ``bucket`` changed moved to the bucket of their old bucket's last
  millisecond (``rebucket``), or reservations held at a clock later than this one (the
  Redis clock went back). Counting them at once is what keeps a width change, a clock
  stepping back and a skewed client from ever under-counting. The error bounds are
  therefore stated against the *seen* total, the events in ``(t_ms - window_ms, +inf)``;
  when no recorded event is later than ``t_ms`` (the normal case) it equals the exact
  trailing total. With every millisecond's net usage non-negative (an adjustment carries
  the ``occurred_ms`` of the charge it corrects and never exceeds it):
  ``exclude <= seen <= include``, ``include - exclude`` is the boundary bucket's usage,
  ``prorate`` lies between them, and ``include >= exact`` always.

* Retry-after (``retry_after``) is the exact earliest ``t' >= t_ms`` (integer ms) at
  which ``total(t') + extra + amount <= limit`` assuming no new usage (buckets already
  recorded, future-dated ones included, keep their amounts). ``amount > limit`` can never
  fit: ``never_fits``. When no instant fits by aging alone (with non-negative usage:
  exactly when ``extra + amount > limit``) the answer is ``fits_at_ms=None`` with
  ``never_fits=False``.

* Policy edits and clocks that step back never under-count. A new ``bucket`` width moves
  each old bucket's amount to the new bucket holding its last millisecond (``rebucket``),
  so it ages out no earlier than before; a bucket that has not begun counts at once (the
  rule above), so the usage of an hour moved to its last minute keeps counting now. The
  over-count is that of the old width: at most one old bucket's usage, counted until its
  last millisecond leaves the window. A new ``window`` keeps the buckets: a shorter one
  counts at once only those it covers, a longer one what the previous one still covered
  (what had left it was dropped). A pending reservation held at a clock later than now
  counts now and until its bucket leaves the window; one pruned at a later clock (its
  bucket had left the window then) stays pruned when the clock steps back.

Buckets older than ``first_live_bucket(t_ms)`` cannot count at ``t_ms`` or later;
``prune`` drops them and a stream processor may drop events that land there as too late.

* Pending reservations (held by admission, not yet absorbed by the stream processor) are
  a second state of the same shape, keyed by the bucket of their admission instant.
  ``combine`` adds it to the absorbed state bucket by bucket, so a reservation ages out
  of the window exactly like absorbed usage: a ``retry_after`` over the combined buckets
  is at most ``window_ms + bucket_ms`` after ``t_ms`` whenever nothing is future-dated.

* When is an amount charged (``settle``)? Every amount lands in the bucket of the instant
  it was asked for: a reservation's estimate at its admission instant, each extend of it
  at the extend's own instant, an overage (actual above everything reserved) at the
  commit's instant. The part of the actual within the reservation replaces it where it
  stands, filling the reservation's slices oldest first (a stream uses what it reserved
  first before what it added later); what is left of a slice is refunded in that slice's
  bucket. So a long stream on a short window keeps paying for what it adds, an overage is
  never free because its reservation aged out, and with nothing future-dated a
  ``retry_after`` is still at most ``window_ms + bucket_ms`` away.

The Lua twin in ``schemas/window.lua`` implements the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spendgate.schemas.types import Boundary

__all__ = [
    "BOUNDARIES",
    "MAX_BUCKET_MS",
    "Boundary",
    "Buckets",
    "Held",
    "RetryAfter",
    "WindowSpec",
    "add",
    "boundary_usage",
    "combine",
    "merge",
    "prune",
    "rebucket",
    "retry_after",
    "settle",
    "total",
]

#: Bucket start (ms since epoch) -> net amount in that bucket.
Buckets = dict[int, int]

BOUNDARIES: tuple[Boundary, ...] = ("include", "exclude", "prorate")

#: Widest bucket: 31 days. It fits the codec's u32 header field and keeps the Lua
#: twin's prorate arithmetic exact in doubles.
MAX_BUCKET_MS = 31 * 86_400_000


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """A trailing window of ``window_ms`` made of aligned ``bucket_ms`` buckets.

    Attributes:
        window_ms: the trailing window length; a positive multiple of ``bucket_ms``.
        bucket_ms: the bucket width; whole seconds, from 1 s up to 31 days.
        boundary: how the oldest, partially covered bucket counts.
    """

    window_ms: int
    bucket_ms: int
    boundary: Boundary = "include"

    def __post_init__(self) -> None:
        """Validate the spec.

        Raises:
            ValueError: a field is out of range; the message names it.
        """
        for name in ("window_ms", "bucket_ms"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ValueError(f"{name}: must be an int number of milliseconds, got {value!r}")
        if not 1000 <= self.bucket_ms <= MAX_BUCKET_MS or self.bucket_ms % 1000:
            raise ValueError(
                f"bucket_ms: {self.bucket_ms} must be whole seconds between 1000 and "
                f"{MAX_BUCKET_MS} (31 days)"
            )
        if self.window_ms < self.bucket_ms or self.window_ms % self.bucket_ms:
            raise ValueError(
                f"window_ms: {self.window_ms} must be a positive multiple of "
                f"bucket_ms {self.bucket_ms}"
            )
        if self.boundary not in BOUNDARIES:
            raise ValueError(f"boundary: {self.boundary!r} is not one of {', '.join(BOUNDARIES)}")

    def bucket_of(self, t_ms: int) -> int:
        """Return the start of the bucket holding ``t_ms`` (floor to ``bucket_ms``)."""
        return t_ms - t_ms % self.bucket_ms

    def first_live_bucket(self, t_ms: int) -> int:
        """Return the oldest bucket start that can still count at ``t_ms`` or later.

        A bucket older than this is outside every window from ``t_ms`` on: ``prune``
        drops it and an event landing in it is too late to matter.
        """
        return self.bucket_of(t_ms + 1) - self.window_ms


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """When a request first fits, assuming no new usage.

    Attributes:
        fits_at_ms: the earliest instant (ms) at which it fits, ``t_ms`` itself when it
            fits now; ``None`` when it never fits by aging alone.
        never_fits: the request alone exceeds the limit (``amount > limit``).
    """

    fits_at_ms: int | None
    never_fits: bool


@dataclass(frozen=True, slots=True)
class Held:
    """One key's usage at an instant: absorbed by the processor plus pending in Redis.

    Attributes:
        buckets: the absorbed and the live pending buckets added bucket by bucket; what
            ``total`` and ``retry_after`` run on.
        absorbed: the total of the absorbed buckets alone (below 0 only when refunds
            exceed the charges they correct).
        pending: what the pending buckets add to the combined total (>= 0 when every
            pending amount is).
    """

    buckets: Buckets
    absorbed: int
    pending: int

    @property
    def used(self) -> int:
        """The absorbed total, never below 0: over-refunds create no extra room."""
        return max(0, self.absorbed)


def add(spec: WindowSpec, buckets: Buckets, occurred_ms: int, amount: int) -> int:
    """Add a signed ``amount`` to the bucket of ``occurred_ms``, in place.

    A bucket whose net amount becomes 0 is removed, keeping the state sparse.

    Args:
        spec: the window definition.
        buckets: the state to update.
        occurred_ms: the event time.
        amount: the signed amount (negative for corrections).

    Returns:
        The start of the bucket that was changed.
    """
    start = occurred_ms - occurred_ms % spec.bucket_ms
    net = buckets.get(start, 0) + amount
    if net:
        buckets[start] = net
    else:
        buckets.pop(start, None)
    return start


def _boundary_part(boundary: Boundary, amount: int, overlap_ms: int, bucket_ms: int) -> int:
    if overlap_ms <= 0 or boundary == "exclude":
        return 0
    if boundary == "include":
        return amount
    return -((-amount * overlap_ms) // bucket_ms)


def total(spec: WindowSpec, buckets: Mapping[int, int], t_ms: int) -> int:
    """Return the bucketed trailing total at ``t_ms`` (see the module docstring).

    Args:
        spec: the window definition.
        buckets: the state.
        t_ms: the query time.

    Returns:
        The full buckets in the window (those after ``t_ms`` included) plus the boundary
        bucket's share.
    """
    bucket_ms = spec.bucket_ms
    r = t_ms % bucket_ms
    head = t_ms - r
    oldest_full = head - spec.window_ms + bucket_ms
    boundary_start = oldest_full - bucket_ms
    if buckets and boundary_start <= min(buckets):
        # Every bucket counts (the usual case for a pruned state): sums in C, not a loop.
        edge = buckets.get(boundary_start, 0)
        full = sum(buckets.values()) - edge
    else:
        full = edge = 0
        for start, amount in buckets.items():
            if oldest_full <= start:
                full += amount
            elif start == boundary_start:
                edge = amount
    return full + _boundary_part(spec.boundary, edge, bucket_ms - 1 - r, bucket_ms)


def boundary_usage(spec: WindowSpec, buckets: Mapping[int, int], t_ms: int) -> int:
    """Return the amount in the boundary bucket at ``t_ms``: the bound on the error.

    Args:
        spec: the window definition.
        buckets: the state.
        t_ms: the query time.

    Returns:
        The boundary bucket's amount, or 0 when the window is whole buckets at ``t_ms``.
    """
    r = t_ms % spec.bucket_ms
    if r == spec.bucket_ms - 1:
        return 0
    return buckets.get(t_ms - r - spec.window_ms, 0)


def prune(spec: WindowSpec, buckets: Buckets, t_ms: int) -> int:
    """Drop, in place, the buckets that cannot count at ``t_ms`` or any later time.

    Totals and retry-after answers at ``t_ms`` and later are unchanged.

    Args:
        spec: the window definition.
        buckets: the state to prune.
        t_ms: the current time (a watermark: no query will ask about earlier times).

    Returns:
        How many buckets were dropped.
    """
    horizon = spec.first_live_bucket(t_ms)
    stale = [start for start in buckets if start < horizon]
    for start in stale:
        del buckets[start]
    return len(stale)


def merge(*states: Mapping[int, int]) -> Buckets:
    """Add states bucket by bucket into a new one; zero sums are dropped.

    Args:
        *states: states in the same bucket width.

    Returns:
        A new state holding, per bucket start, the sum of every state's amount.
    """
    merged: Buckets = {}
    for state in states:
        for start, amount in state.items():
            merged[start] = merged.get(start, 0) + amount
    return {start: amount for start, amount in merged.items() if amount}


def combine(
    spec: WindowSpec, absorbed: Mapping[int, int], pending: Mapping[int, int], t_ms: int
) -> Held:
    """Combine a key's absorbed buckets with its pending ones at ``t_ms``.

    Pending buckets that can no longer count (older than ``first_live_bucket(t_ms)``)
    are left out, as the admission script prunes them.

    Args:
        spec: the window definition.
        absorbed: the state the stream processor wrote.
        pending: the reservations admission holds that the processor has not absorbed,
            per bucket of their admission instant.
        t_ms: the decision time.

    Returns:
        The combined buckets, the absorbed total and the pending part of the total.
    """
    horizon = spec.first_live_bucket(t_ms)
    live = {start: amount for start, amount in pending.items() if start >= horizon}
    buckets = merge(absorbed, live) if live else dict(absorbed)
    absorbed_total = total(spec, absorbed, t_ms)
    return Held(buckets, absorbed_total, total(spec, buckets, t_ms) - absorbed_total)


def _earliest_offset(
    boundary: Boundary, edge: int, slack: int, r_lo: int, bucket_ms: int
) -> int | None:
    """Smallest ``r`` in ``[r_lo, bucket_ms)`` with ``boundary part(r) <= slack``."""
    last = bucket_ms - 1
    if edge == 0 or boundary == "exclude":
        return r_lo if slack >= 0 else None
    if boundary == "include":
        if r_lo < last and edge <= slack:
            return r_lo
        return last if slack >= 0 else None
    # prorate: part(r) = ceil(edge * k / bucket_ms) with k = last - r overlapped ms, and
    # ceil(y) <= slack  <=>  y <= slack, i.e. edge * k <= slack * bucket_ms.
    k_hi = last - r_lo
    if edge > 0:
        if slack < 0:
            return None
        return last - min(k_hi, (slack * bucket_ms) // edge)
    return r_lo if edge * k_hi <= slack * bucket_ms else None


def retry_after(
    spec: WindowSpec,
    buckets: Mapping[int, int],
    t_ms: int,
    *,
    limit: int,
    amount: int,
    extra: int = 0,
) -> RetryAfter:
    """Find the earliest instant a request fits, assuming no new usage.

    The total is piecewise in time: within one head-bucket period only the boundary
    share changes, and a period can differ from the previous period's last millisecond
    only when a bucket leaves it or is its boundary bucket (every recorded bucket counts
    from now on). The scan visits those periods in order and solves each one exactly.

    Args:
        spec: the window definition.
        buckets: the state.
        t_ms: the current time.
        limit: the budget ceiling.
        amount: the request's amount (>= 0).
        extra: other usage held that does not age out here, such as open
            reservations (>= 0).

    Returns:
        ``RetryAfter(t', False)`` with the earliest ``t' >= t_ms`` such that
        ``total(t') + extra + amount <= limit``; ``RetryAfter(None, True)`` when
        ``amount > limit``; ``RetryAfter(None, False)`` when aging alone never makes
        room (with non-negative usage: ``extra + amount > limit``).

    Raises:
        ValueError: ``amount`` or ``extra`` is negative.
    """
    if amount < 0 or extra < 0:
        raise ValueError(f"amount ({amount}) and extra ({extra}) must be >= 0")
    if amount > limit:
        return RetryAfter(None, True)
    if total(spec, buckets, t_ms) + extra + amount <= limit:
        return RetryAfter(t_ms, False)  # the common case, without sorting anything
    window_ms = spec.window_ms
    bucket_ms = spec.bucket_ms
    head = t_ms - t_ms % bucket_ms
    starts = sorted(buckets)
    # Between these periods nothing changes: a period where no bucket enters and none
    # is the boundary totals what the previous period totals at its last millisecond.
    periods = {head}
    for start in starts:
        periods.add(max(head, start))
        periods.add(max(head, start + window_ms))
    room = limit - extra - amount
    count = len(starts)
    # Every bucket counts from now on (those after head too) until it leaves the window.
    lo, hi = 0, count
    full = sum(buckets.values())
    for period in sorted(periods):
        oldest_full = period - window_ms + bucket_ms
        while lo < hi and starts[lo] < oldest_full:
            full -= buckets[starts[lo]]
            lo += 1
        r_lo = t_ms - period if period == head else 0
        edge = buckets.get(period - window_ms, 0)
        r = _earliest_offset(spec.boundary, edge, room - full, r_lo, bucket_ms)
        if r is not None:
            return RetryAfter(period + r, False)
    return RetryAfter(None, False)


def rebucket(buckets: Mapping[int, int], old_bucket_ms: int, new_bucket_ms: int) -> Buckets:
    """Move buckets of width ``old_bucket_ms`` to width ``new_bucket_ms`` (a policy change).

    Each old bucket's amount goes to the new bucket holding the old bucket's *last*
    millisecond, so no usage ages out earlier than it would have; a new bucket that has
    not begun counts at once (``total``), so none counts later either: with ``include``
    the window still never under-counts, over by at most one old bucket. Zero sums are
    dropped.

    Args:
        buckets: the state in the old width.
        old_bucket_ms: the width the state was kept in.
        new_bucket_ms: the policy's new width.

    Returns:
        A new state in the new width.
    """
    moved: Buckets = {}
    for start, value in buckets.items():
        last = start + old_bucket_ms - 1
        target = last - last % new_bucket_ms
        moved[target] = moved.get(target, 0) + value
    return {k: v for k, v in moved.items() if v}


def settle(
    slices: Sequence[tuple[int, int]], actual: int, commit_ms: int, aged: int = 0
) -> tuple[list[tuple[int, int]], int]:
    """The charges a commit makes against its reservation (the rule in the module docstring).

    Args:
        slices: what the reservation charged so far, as ``(ms, amount)`` in time order:
            the estimate at its admission instant, then each extend at its instant
            (amounts >= 0).
        actual: the committed usage (>= 0; 0 for a release).
        commit_ms: the commit's instant (where an overage lands).
        aged: reserved amounts whose slices already left every window, older than every
            slice in ``slices``: they are filled first and refund nothing.

    Returns:
        ``(charges, overage)``: the signed ``(ms, delta)`` charges to add (zero deltas
        left out; refunds of unused slices at their own instants, the overage at
        ``commit_ms``) and the overage amount (``actual`` above everything reserved).

    Raises:
        ValueError: a negative amount.
    """
    if actual < 0 or aged < 0 or any(a < 0 for _, a in slices):
        raise ValueError("settle: amounts must be >= 0")
    rest = max(0, actual - aged)
    charges: list[tuple[int, int]] = []
    for ms, held in slices:
        kept = min(rest, held)
        rest -= kept
        if kept != held:
            charges.append((ms, kept - held))
    if rest:
        charges.append((commit_ms, rest))
    return charges, rest
