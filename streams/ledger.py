"""Pure per-budget-key accounting: buckets, dedupe and the reservation lifecycle.

One ``KeyState`` holds everything about one budget key, so the buckets, the dedupe
memory, open reservations and alert bookkeeping are written in one table record (one
changelog message) and commit together.

Clock: event time only. A key's clock is the latest ``occurred_at`` it has seen
(``high_ms``): it decides what is too late, what is pruned, and when a reservation counts
as expired. No wall clock is read, so a replay of the same records reproduces the same
state and the same alerts. A reservation's estimate sits in the bucket of its
``occurred_at`` from its ``reserve`` until its ``commit`` replaces it or its ``release``
frees it; expiry changes no amount (the estimate simply stays charged), so windows do not
depend on when expiry is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from schemas import windows
from schemas.events import ReleaseEvent, ReserveEvent, UsageEvent
from schemas.matching import BudgetTarget
from schemas.prices import PriceCatalog
from schemas.types import Boundary
from schemas.units import amount
from schemas.windows import WindowSpec

Kind = Literal["reserve", "commit", "release", "adjust"]
Outcome = Literal["applied", "duplicate", "late_dropped"]


@dataclass(frozen=True, slots=True)
class KeyedRecord:
    """One usage event as it concerns one budget key (the repartitioned stream's value)."""

    event_id: str
    kind: Kind
    policy: str
    key: str
    occurred_ms: int
    amount: int
    window_ms: int
    bucket_ms: int
    horizon_ms: int
    limit: int
    boundary: Boundary = "include"
    thresholds: tuple[float, ...] = ()
    reservation_id: str | None = None
    expires_ms: int | None = None
    #: Broker timestamp of the usage record this came from (for the lag metric only).
    broker_ms: int = 0

    @property
    def spec(self) -> WindowSpec:
        """The policy's window as the engine wants it."""
        return WindowSpec(self.window_ms, self.bucket_ms, self.boundary)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the repartition topic's value)."""
        out = {k: getattr(self, k) for k in self.__slots__}
        out["thresholds"] = list(self.thresholds)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KeyedRecord:
        """Inverse of :meth:`to_json`."""
        return cls(**{**raw, "thresholds": tuple(raw.get("thresholds", ()))})


@dataclass(slots=True)
class KeyState:
    """The state of one budget key: buckets (start ms -> amount) and what was seen."""

    buckets: dict[int, int] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    #: reservation id -> (occurred_ms, estimate, expires_ms) of reservations still open.
    reservations: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    settled: dict[str, int] = field(default_factory=dict)
    #: The latest event time seen on this key: the key's clock (see module docstring).
    high_ms: int = 0
    #: The bucket width the buckets are kept in (0: none yet) and the policy's window.
    bucket_ms: int = 0
    window_ms: int = 0
    #: Alert bookkeeping: crossings so far per alert line, the lines usage is above now,
    #: and reservations already reported expired.
    crossings: dict[str, int] = field(default_factory=dict)
    above: set[str] = field(default_factory=set)
    expired: set[str] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        """Serialize for the table (JSON object keys are strings)."""
        return {
            "b": {str(k): v for k, v in self.buckets.items()},
            "seen": self.seen,
            "res": {k: list(v) for k, v in self.reservations.items()},
            "settled": self.settled,
            "hwm": self.high_ms,
            "bw": self.bucket_ms,
            "ww": self.window_ms,
            "x": self.crossings,
            "above": sorted(self.above),
            "exp": sorted(self.expired),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> KeyState:
        """Inverse of :meth:`to_json`; ``None`` is an empty state."""
        if not raw:
            return cls()
        return cls(
            buckets={int(k): int(v) for k, v in raw["b"].items()},
            seen=dict(raw["seen"]),
            reservations={k: (v[0], v[1], v[2]) for k, v in raw["res"].items()},
            settled=dict(raw["settled"]),
            high_ms=int(raw["hwm"]),
            bucket_ms=int(raw.get("bw", 0)),
            window_ms=int(raw.get("ww", 0)),
            crossings=dict(raw.get("x", {})),
            above=set(raw.get("above", ())),
            expired=set(raw.get("exp", ())),
        )


@dataclass(frozen=True, slots=True)
class Change:
    """What applying one record did: the outcome, the buckets it touched, whether old
    buckets were pruned, and the reservation whose pending entry it absorbs."""

    outcome: Outcome
    touched: tuple[int, ...] = ()
    pruned: bool = False
    absorbed: str | None = None

    @property
    def buckets_changed(self) -> bool:
        """Whether the key's bucket state differs from before."""
        return bool(self.touched) or self.pruned


def _charge(
    spec: WindowSpec, state: KeyState, occurred_ms: int, delta: int, touched: list[int]
) -> None:
    if delta:
        touched.append(windows.add(spec, state.buckets, occurred_ms, delta))


def apply(state: KeyState, rec: KeyedRecord) -> Change:
    """Apply one record to ``state`` in place and say what changed."""
    absorbed = rec.reservation_id if rec.kind == "reserve" else None
    if rec.event_id in state.seen:
        return Change("duplicate", absorbed=absorbed)
    spec = rec.spec
    state.window_ms = rec.window_ms
    rebucketed = _rebucket(state, rec.bucket_ms)
    state.seen[rec.event_id] = rec.occurred_ms
    if spec.bucket_of(rec.occurred_ms) < spec.first_live_bucket(state.high_ms):
        return Change("late_dropped", absorbed=absorbed)
    touched: list[int] = []
    rid = rec.reservation_id
    if rec.kind == "reserve" and rid is not None:
        if rid not in state.settled:
            _charge(spec, state, rec.occurred_ms, rec.amount, touched)
            state.reservations[rid] = (
                rec.occurred_ms,
                rec.amount,
                rec.expires_ms or rec.occurred_ms,
            )
    elif rec.kind in ("commit", "release") and rid is not None:
        held = state.reservations.pop(rid, None)
        state.settled[rid] = rec.occurred_ms
        actual = rec.amount if rec.kind == "commit" else 0
        if held is not None:
            # The actual usage replaces the estimate in the reservation's own bucket.
            _charge(spec, state, held[0], actual - held[1], touched)
        else:
            _charge(spec, state, rec.occurred_ms, actual, touched)
    else:
        _charge(spec, state, rec.occurred_ms, rec.amount, touched)
    pruned = False
    if spec.bucket_of(rec.occurred_ms) > spec.bucket_of(state.high_ms):
        # Time entered a new bucket: forget what no window or dedupe horizon can reach.
        state.high_ms = rec.occurred_ms
        pruned = _prune(spec, state, rec.horizon_ms)
    state.high_ms = max(state.high_ms, rec.occurred_ms)
    return Change("applied", tuple(touched), pruned or rebucketed, absorbed)


def _rebucket(state: KeyState, bucket_ms: int) -> bool:
    """Move the buckets to a new width after a policy changed its ``bucket``.

    Each old bucket's amount goes to the new bucket holding the old bucket's *last*
    millisecond, so no usage ages out earlier than it would have: never under-counts.
    """
    old = state.bucket_ms
    state.bucket_ms = bucket_ms
    if old in (0, bucket_ms) or not state.buckets:
        return False
    state.buckets = windows.rebucket(state.buckets, old, bucket_ms)
    return True


def _prune(spec: WindowSpec, state: KeyState, horizon_ms: int) -> bool:
    dropped = windows.prune(spec, state.buckets, state.high_ms)
    live = spec.first_live_bucket(state.high_ms)
    forget = state.high_ms - horizon_ms
    state.seen = {k: v for k, v in state.seen.items() if v > forget}
    state.settled = {k: v for k, v in state.settled.items() if v > forget}
    state.reservations = {
        k: v for k, v in state.reservations.items() if spec.bucket_of(v[0]) >= live
    }
    state.expired &= state.reservations.keys()
    return dropped > 0


def keyed_record(
    event: UsageEvent,
    target: BudgetTarget,
    horizon_ms: int,
    prices: PriceCatalog | None = None,
    occurred_ms: int | None = None,
) -> KeyedRecord:
    """The record one event contributes to one budget key.

    ``occurred_ms`` overrides the event's own time (a clamped future timestamp).

    Raises:
        UnitError: the event's usage cannot be expressed in the policy's unit.
    """
    policy = target.policy
    usage_amount = (
        0
        if isinstance(event, ReleaseEvent)
        else amount(policy, event.usage, prices, model=event.subject.model)
    )
    return KeyedRecord(
        event_id=event.event_id,
        kind=event.kind,
        policy=policy.id,
        key=target.key,
        occurred_ms=event.occurred_ms if occurred_ms is None else occurred_ms,
        amount=usage_amount,
        window_ms=policy.window_ms,
        bucket_ms=policy.bucket_ms,
        horizon_ms=max(horizon_ms, policy.window_ms),
        limit=policy.limit,
        boundary=policy.boundary,
        thresholds=tuple(policy.alerts),
        reservation_id=getattr(event, "reservation_id", None),
        expires_ms=event.expires_ms if isinstance(event, ReserveEvent) else None,
    )
