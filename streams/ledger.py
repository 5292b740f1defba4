"""Pure per-budget-key accounting: buckets, dedupe and the reservation lifecycle.

One ``KeyState`` holds everything about one budget key, so the buckets and the dedupe
memory are written in one table record (one changelog message) and commit together.
No I/O and no clock: event time comes in the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from schemas import windows
from schemas.events import ReleaseEvent, ReserveEvent, UsageEvent
from schemas.matching import BudgetTarget
from schemas.prices import PriceCatalog
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
    reservation_id: str | None = None
    expires_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the repartition topic's value)."""
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KeyedRecord:
        """Inverse of :meth:`to_json`."""
        return cls(**raw)


@dataclass(slots=True)
class KeyState:
    """The state of one budget key: buckets (start ms -> amount) and what was seen."""

    buckets: dict[int, int] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    #: reservation id -> (occurred_ms, estimate, expires_ms) of reservations still open.
    reservations: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    settled: dict[str, int] = field(default_factory=dict)
    high_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        """Serialize for the table (JSON object keys are strings)."""
        return {
            "b": {str(k): v for k, v in self.buckets.items()},
            "seen": self.seen,
            "res": {k: list(v) for k, v in self.reservations.items()},
            "settled": self.settled,
            "hwm": self.high_ms,
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
    spec = WindowSpec(rec.window_ms, rec.bucket_ms)
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
    return Change("applied", tuple(touched), pruned, absorbed)


def _prune(spec: WindowSpec, state: KeyState, horizon_ms: int) -> bool:
    dropped = windows.prune(spec, state.buckets, state.high_ms)
    live = spec.first_live_bucket(state.high_ms)
    forget = state.high_ms - horizon_ms
    state.seen = {k: v for k, v in state.seen.items() if v > forget}
    state.settled = {k: v for k, v in state.settled.items() if v > forget}
    state.reservations = {
        k: v for k, v in state.reservations.items() if spec.bucket_of(v[0]) >= live
    }
    return dropped > 0


def keyed_record(
    event: UsageEvent, target: BudgetTarget, horizon_ms: int, prices: PriceCatalog | None = None
) -> KeyedRecord:
    """The record one event contributes to one budget key.

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
        occurred_ms=event.occurred_ms,
        amount=usage_amount,
        window_ms=policy.window_ms,
        bucket_ms=policy.bucket_ms,
        horizon_ms=max(horizon_ms, policy.window_ms),
        reservation_id=getattr(event, "reservation_id", None),
        expires_ms=event.expires_ms if isinstance(event, ReserveEvent) else None,
    )
