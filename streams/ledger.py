"""Pure per-budget-key accounting: buckets, redelivery by position, reservations.

One ``KeyState`` holds everything about one budget key that its window needs, so it is
written in one table record (one changelog message) and its size depends on the window,
never on how many events the key has seen: the buckets (the compact codec), the open
reservations, the alert marks, and per source partition the offset of the last record
applied. A record at or below that offset is a *redelivery* (the worker died between
writing the state and committing its offsets) and changes nothing. Producer duplicates
(the same ``event_id`` at another offset) never reach this module: ``streams.dedupe``
drops them before the fan-out.

Clock: event time only. A key's clock is the latest ``occurred_at`` it has seen
(``high_ms``): it decides what is too late, what is pruned, and when a reservation counts
as expired. No wall clock is read, so a replay of the same records reproduces the same
state and the same alerts. A reservation's estimate sits in the bucket of its
``occurred_at`` from its ``reserve``, each ``extend`` in the bucket of its own
``occurred_at``, until its ``commit`` settles them (``schemas.windows.settle``: the actual
fills the slices oldest first where they stand, any overage lands at the commit's instant)
or its ``release`` frees them; expiry changes no amount (the estimate simply stays
charged), so windows do not depend on when expiry is noticed. A reservation whose every
slice left the window is forgotten; a commit of it then charges in full at its instant.

Table value format (``KeyState.to_bytes``), version 2::

    u8 2 | u32 n (little-endian) | n bytes: buckets in the schemas.window_codec layout
         | JSON: reservations, clock, widths, alert marks, offsets

Version 1 (a JSON object that also kept every event id seen) is read and converted.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple

import orjson

from spendgate.schemas import window_codec, windows
from spendgate.schemas.events import EventKind, ExtendEvent, ReleaseEvent, ReserveEvent, UsageEvent
from spendgate.schemas.matching import BudgetTarget
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.types import Boundary
from spendgate.schemas.units import amount
from spendgate.schemas.windows import WindowSpec

#: The kinds of event (one table: ``schemas.events.EventKind``).
Kind = EventKind
Outcome = Literal["applied", "redelivery", "late_dropped"]


class Hold(NamedTuple):
    """An open reservation as its key holds it.

    Attributes:
        expires_ms: its ``expires_at`` (0 while only extends of it were seen).
        slices: what it charged so far, ``(ms, amount)`` oldest first: the estimate at its
            admission instant, each extend at its instant (one slice per bucket).
        aged: what its slices that left every window held (still reserved, refunds nothing).
        estimate: the reserve's estimate (for the overage alert; 0 until the reserve is seen).
    """

    expires_ms: int
    slices: tuple[tuple[int, int], ...]
    aged: int = 0
    estimate: int = 0

    @property
    def reserved(self) -> int:
        """Everything reserved: the estimate and every extend."""
        return self.aged + sum(a for _, a in self.slices)


#: The table value format written by :meth:`KeyState.to_bytes`.
STATE_VERSION = 2
_LEN = struct.Struct("<I")


@functools.lru_cache(maxsize=4096)
def _spec(window_ms: int, bucket_ms: int, boundary: Boundary) -> WindowSpec:
    # Checked once per policy window rather than on every record (specs are immutable).
    return WindowSpec(window_ms, bucket_ms, boundary)


@dataclass(frozen=True, slots=True)
class KeyedRecord:
    """One usage event as it concerns one budget key (the repartitioned stream's value).

    ``src_partition``/``src_offset`` are the usage record's position in ``budget.usage``;
    a key applies each position once. ``settled`` marks a ``reserve`` whose reservation
    was committed or released before it arrived (it charges nothing).
    """

    event_id: str
    kind: Kind
    policy: str
    key: str
    occurred_ms: int
    amount: int
    window_ms: int
    bucket_ms: int
    limit: int
    src_partition: int
    src_offset: int
    boundary: Boundary = "include"
    thresholds: tuple[float, ...] = ()
    reservation_id: str | None = None
    expires_ms: int | None = None
    settled: bool = False
    #: Broker timestamp of the usage record this came from (for the lag metric only).
    broker_ms: int = 0
    #: The policy's forecast alert horizon (0: none; ``streams.alerting``).
    forecast_ms: int = 0

    @property
    def spec(self) -> WindowSpec:
        """The policy's window as the engine wants it."""
        return _spec(self.window_ms, self.bucket_ms, self.boundary)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the repartition topic's value)."""
        out = {k: getattr(self, k) for k in self.__slots__}
        out["thresholds"] = list(self.thresholds)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KeyedRecord:
        """Inverse of :meth:`to_json` (fields it does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        values["thresholds"] = tuple(raw.get("thresholds", ()))
        return cls(**values)


@dataclass(slots=True)
class KeyState:
    """The state of one budget key: buckets (start ms -> amount) and what the window needs."""

    buckets: dict[int, int] = field(default_factory=dict)
    #: reservation id -> what it holds, of reservations still open.
    reservations: dict[str, Hold] = field(default_factory=dict)
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
    #: Source partition -> offset of the last record applied (redelivery by position).
    offsets: dict[int, int] = field(default_factory=dict)

    @property
    def version(self) -> int:
        """How many records this state has applied, as far as positions tell: the sum of
        ``offsets + 1`` over source partitions. It grows with every record applied, so a
        window written with a higher version is newer."""
        return sum(offset + 1 for offset in self.offsets.values())

    def to_bytes(self, window: bytes | None = None) -> bytes:
        """Serialize for the table (format version 2, see the module docstring).

        ``window``: the buckets already encoded (``window_codec.encode`` at this state's
        bucket width), when the caller has them.
        """
        body = window
        if body is None:
            body = window_codec.encode(self.buckets, self.bucket_ms) if self.bucket_ms else b""
        rest = {
            "res": {k: _hold_json(v) for k, v in self.reservations.items()},
            "hwm": self.high_ms,
            "bw": self.bucket_ms,
            "ww": self.window_ms,
            "x": self.crossings,
            "above": sorted(self.above),
            "exp": sorted(self.expired),
            "off": {str(k): v for k, v in self.offsets.items()},
        }
        return bytes([STATE_VERSION]) + _LEN.pack(len(body)) + body + orjson.dumps(rest)

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> KeyState:
        """Inverse of :meth:`to_bytes`; ``None`` is an empty state.

        Version 1 values (JSON) are converted: their event ids and settled reservation
        ids are dropped (``streams.dedupe`` keeps those now, rebuilt from the topic).

        Raises:
            ValueError: the value is in no format this version knows.
        """
        if not raw:
            return cls()
        if raw[0] == ord("{"):
            return cls._from_v1(orjson.loads(raw))
        if raw[0] != STATE_VERSION:
            raise ValueError(f"key state format {raw[0]} is newer than this worker knows")
        (n,) = _LEN.unpack_from(raw, 1)
        body, rest = raw[5 : 5 + n], orjson.loads(raw[5 + n :])
        return cls(
            buckets=dict(window_codec.decode(body).buckets) if n else {},
            reservations={k: _hold_of(v) for k, v in rest["res"].items()},
            high_ms=rest["hwm"],
            bucket_ms=rest["bw"],
            window_ms=rest["ww"],
            crossings=rest["x"],
            above=set(rest["above"]),
            expired=set(rest["exp"]),
            offsets={int(k): v for k, v in rest["off"].items()},
        )

    @classmethod
    def _from_v1(cls, raw: dict[str, Any]) -> KeyState:
        return cls(
            buckets={int(k): int(v) for k, v in raw["b"].items()},
            reservations={k: _hold_of(v) for k, v in raw["res"].items()},
            high_ms=int(raw["hwm"]),
            bucket_ms=int(raw.get("bw", 0)),
            window_ms=int(raw.get("ww", 0)),
            crossings=dict(raw.get("x", {})),
            above=set(raw.get("above", ())),
            expired=set(raw.get("exp", ())),
        )


def _hold_json(hold: Hold) -> list[Any]:
    # Format 2 wrote [occurred_ms, estimate, expires_ms]; a reservation that is one slice
    # still does (readable by older workers), an extended one adds its slices and aged part.
    if len(hold.slices) == 1 and not hold.aged and hold.slices[0][1] == hold.estimate:
        ms, est = hold.slices[0]
        return [ms, est, hold.expires_ms]
    return [0, hold.estimate, hold.expires_ms, [list(x) for x in hold.slices], hold.aged]


def _hold_of(raw: list[Any]) -> Hold:
    if len(raw) == 3:
        return Hold(raw[2], ((raw[0], raw[1]),), 0, raw[1])
    return Hold(raw[2], tuple((ms, a) for ms, a in raw[3]), raw[4], raw[1])


@dataclass(frozen=True, slots=True)
class Change:
    """What applying one record did: the outcome, the buckets it touched, whether old
    buckets were pruned, the pending entry it absorbs (a reservation id, or an extend's
    event id), and for a commit above its reservation the overage and the reservation as
    it stood (``overage``: ``(estimate, reserved, actual)``)."""

    outcome: Outcome
    touched: tuple[int, ...] = ()
    pruned: bool = False
    absorbed: str | None = None
    overage: tuple[int, int, int] | None = None

    @property
    def buckets_changed(self) -> bool:
        """Whether Redis must get the key's window again: its buckets differ from
        before, or this is a redelivery (the first attempt may have died before its
        Redis write; rewriting the whole window is idempotent)."""
        return bool(self.touched) or self.pruned or self.outcome == "redelivery"


def _charge(
    spec: WindowSpec, state: KeyState, occurred_ms: int, delta: int, touched: list[int]
) -> None:
    if delta:
        touched.append(windows.add(spec, state.buckets, occurred_ms, delta))


def apply(state: KeyState, rec: KeyedRecord) -> Change:
    """Apply one record to ``state`` in place and say what changed.

    A record whose source position is at or below the key's offset for that partition
    was applied before (a redelivery) and changes nothing.
    """
    absorbed = _absorbs(rec)
    if rec.src_offset <= state.offsets.get(rec.src_partition, -1):
        return Change("redelivery", absorbed=absorbed)
    state.offsets[rec.src_partition] = rec.src_offset
    spec = rec.spec
    state.window_ms = rec.window_ms
    rebucketed = _rebucket(state, rec.bucket_ms)
    if spec.bucket_of(rec.occurred_ms) < spec.first_live_bucket(state.high_ms):
        return Change("late_dropped", pruned=rebucketed, absorbed=absorbed)
    touched: list[int] = []
    rid = rec.reservation_id
    overage: tuple[int, int, int] | None = None
    if rec.kind in ("reserve", "extend") and rid is not None:
        if not rec.settled:
            _charge(spec, state, rec.occurred_ms, rec.amount, touched)
            _hold(spec, state, rid, rec)
    elif rec.kind in ("commit", "release") and rid is not None:
        held = state.reservations.pop(rid, None)
        state.expired.discard(rid)
        actual = rec.amount if rec.kind == "commit" else 0
        if held is not None:
            # The actual fills the reservation where it stands; an overage lands now.
            charges, over = windows.settle(held.slices, actual, rec.occurred_ms, held.aged)
            for ms, delta in charges:
                _charge(spec, state, ms, delta, touched)
            if over:
                overage = (held.estimate, held.reserved, actual)
        else:
            _charge(spec, state, rec.occurred_ms, actual, touched)
    else:
        _charge(spec, state, rec.occurred_ms, rec.amount, touched)
    pruned = False
    if spec.bucket_of(rec.occurred_ms) > spec.bucket_of(state.high_ms):
        # Time entered a new bucket: forget what no window can reach any more.
        state.high_ms = rec.occurred_ms
        pruned = _prune(spec, state)
    state.high_ms = max(state.high_ms, rec.occurred_ms)
    return Change("applied", tuple(touched), pruned or rebucketed, absorbed, overage)


def _absorbs(rec: KeyedRecord) -> str | None:
    """The pending entry (in Redis) a record's window accounts for, if any: a reserve's
    reservation id, an extend's event id (``schemas.events.extend_event_id``)."""
    if rec.kind == "reserve":
        return rec.reservation_id
    if rec.kind == "extend":
        return rec.event_id
    return None


def _hold(spec: WindowSpec, state: KeyState, rid: str, rec: KeyedRecord) -> None:
    """Add a reserve's estimate or an extend's amount to its reservation's slices.

    Slices are kept one per bucket, at the bucket's last millisecond (where a rebucket
    moves a bucket's amount), so a reservation's size is bounded by its window.
    """
    held = state.reservations.get(rid) or Hold(0, ())
    at = spec.bucket_of(rec.occurred_ms) + spec.bucket_ms - 1
    slices = dict(held.slices)
    slices[at] = slices.get(at, 0) + rec.amount
    expires_ms, estimate = held.expires_ms, held.estimate
    if rec.kind == "reserve":
        expires_ms, estimate = rec.expires_ms or rec.occurred_ms, rec.amount
    state.reservations[rid] = Hold(expires_ms, tuple(sorted(slices.items())), held.aged, estimate)


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


def _prune(spec: WindowSpec, state: KeyState) -> bool:
    dropped = windows.prune(spec, state.buckets, state.high_ms)
    live = spec.first_live_bucket(state.high_ms)
    kept: dict[str, Hold] = {}
    for rid, held in state.reservations.items():
        if spec.bucket_of(held.slices[-1][0]) < live:
            continue  # every slice left the window: forgotten
        if spec.bucket_of(held.slices[0][0]) < live:
            gone = [a for ms, a in held.slices if spec.bucket_of(ms) < live]
            left = tuple(x for x in held.slices if spec.bucket_of(x[0]) >= live)
            held = held._replace(slices=left, aged=held.aged + sum(gone))
        kept[rid] = held
    state.reservations = kept
    state.expired &= state.reservations.keys()
    return dropped > 0


@dataclass(frozen=True, slots=True)
class PolicyTerms:
    """What every record of one policy carries: its id, window, limit and alert figures.

    The one builder of :class:`KeyedRecord` (:meth:`record`): the fold makes one per policy
    version, a keyed batch one per batch (``streams.remote``).
    """

    policy: str
    window_ms: int
    bucket_ms: int
    limit: int
    boundary: Boundary = "include"
    thresholds: tuple[float, ...] = ()
    forecast_ms: int = 0

    @classmethod
    def of(cls, policy: Policy) -> PolicyTerms:
        """The terms of ``policy`` as it stands."""
        return cls(
            policy.id,
            policy.window_ms,
            policy.bucket_ms,
            policy.limit,
            policy.boundary,
            tuple(policy.alerts),
            policy.forecast_ms,
        )

    def record(
        self,
        key: str,
        *,
        event_id: str,
        kind: Kind,
        occurred_ms: int,
        amount: int,
        src_partition: int,
        src_offset: int,
        reservation_id: str | None = None,
        expires_ms: int | None = None,
        settled: bool = False,
        broker_ms: int = 0,
    ) -> KeyedRecord:
        """The record of one event for budget key ``key`` under these terms."""
        return KeyedRecord(
            event_id=event_id,
            kind=kind,
            policy=self.policy,
            key=key,
            occurred_ms=occurred_ms,
            amount=amount,
            window_ms=self.window_ms,
            bucket_ms=self.bucket_ms,
            limit=self.limit,
            src_partition=src_partition,
            src_offset=src_offset,
            boundary=self.boundary,
            thresholds=self.thresholds,
            reservation_id=reservation_id,
            expires_ms=expires_ms,
            settled=settled,
            broker_ms=broker_ms,
            forecast_ms=self.forecast_ms,
        )


def keyed_record(
    event: UsageEvent,
    target: BudgetTarget,
    *,
    src_partition: int,
    src_offset: int,
    prices: PriceCatalog | None = None,
    occurred_ms: int | None = None,
    settled: bool = False,
) -> KeyedRecord:
    """The record one event contributes to one budget key.

    Args:
        event: the validated usage event.
        target: the policy and budget key it feeds.
        src_partition: the usage record's partition.
        src_offset: the usage record's offset.
        prices: the price catalog for ``cost_usd`` policies.
        occurred_ms: overrides the event's own time (a clamped future timestamp).
        settled: the reservation of this ``reserve`` was already settled.

    Raises:
        UnitError: the event's usage cannot be expressed in the policy's unit.
    """
    policy = target.policy
    usage_amount = (
        0
        if isinstance(event, ReleaseEvent)
        else amount(policy, event.usage, prices, model=event.subject.model)
    )
    return PolicyTerms.of(policy).record(
        target.key,
        event_id=event.event_id,
        kind=event.kind,
        occurred_ms=event.occurred_ms if occurred_ms is None else occurred_ms,
        amount=usage_amount,
        src_partition=src_partition,
        src_offset=src_offset,
        reservation_id=getattr(event, "reservation_id", None),
        expires_ms=event.expires_ms if isinstance(event, ReserveEvent) else None,
        settled=settled and isinstance(event, ReserveEvent | ExtendEvent),
    )
