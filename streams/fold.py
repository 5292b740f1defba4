"""The worker's pure batch fold: raw usage records in; key states, Redis writes, alerts out.

One fold serves the live worker, ``replay`` and ``simulate``. Per record it does what the
per-record reference path (``tests.fixtures.fanout.fan_out``, then per budget key
``apply`` and ``evaluate``) does, in the same order, so batch boundaries change nothing:
every event is applied and its alerts are evaluated one at a time; only the *writes* are
per batch (one table value and one Redis write per touched key).

Where a key is accounted: a *local* key (``schemas.shards.tenant_scoped`` by default) only
ever sees events of one tenant, and ``budget.usage`` is keyed by tenant, so all its events live in
one source partition and :func:`fold_usage` applies them right there. Every other key is
*remote*: :func:`fold_usage` returns one :class:`streams.remote.RemoteBatch` per (key,
source partition), and :func:`fold_keyed` applies those where the keyed topic delivers
them. Producer duplicates are dropped before either (``streams.dedupe``).

Records refused because the key's state would outgrow ``max_value_bytes`` are refused one
by one, as the per-record path refuses them: a cheap upper bound on the state's encoded size
decides when a record needs the exact check (a snapshot before it, the encoding after it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, cast

import msgspec
import orjson
from pydantic import ValidationError

from spendgate.schemas import window_codec
from spendgate.schemas.alerts import Alert
from spendgate.schemas.events import Usage
from spendgate.schemas.exceptions import SpendgateError
from spendgate.schemas.fastdecode import Event, decode
from spendgate.schemas.overage import OverageMark, ratio_milli
from spendgate.schemas.units import amount
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.alerting import evaluate
from spendgate.streams.dedupe import IdStore, Position
from spendgate.streams.effects import Counts, FoldResult, KeyWrite, Refusal
from spendgate.streams.ids import invalid_reason, note_ids
from spendgate.streams.ledger import Change, KeyedRecord, KeyState, apply
from spendgate.streams.remote import Entry, RemoteBatch
from spendgate.streams.rules import Plan, Rules

__all__ = [
    "Counts",
    "FoldResult",
    "KeyWrite",
    "KeyedMessage",
    "Load",
    "Refusal",
    "Rules",
    "UsageRecord",
    "fold_keyed",
    "fold_usage",
]

#: A key's stored state when the batch first touches it (empty when it has none); the fold
#: changes it in place.
Load = Callable[[str], KeyState]


class UsageRecord(NamedTuple):
    """A record of ``budget.usage``: position, broker (``LogAppendTime``) ms, value."""

    partition: int
    offset: int
    broker_ms: int
    value: bytes


class KeyedMessage(NamedTuple):
    """A message of the keyed topic: its own position and value (a :class:`RemoteBatch`)."""

    partition: int
    offset: int
    value: bytes


#: Generous upper bounds of the JSON bytes one item of a key's state takes (see
#: ``KeyState.to_bytes``): an id (<= 200 characters, <= 6 bytes each once escaped) with
#: its quotes; a reservation (its id and three integers); an alert line; an offset.
_ID_BYTES = 1_204
_RES_BYTES = _ID_BYTES + 70
_LINE_BYTES = 200
_OFFSET_BYTES = 50
_SLICE_BYTES = 50
_FIXED_BYTES = 5 + window_codec.HEADER_SIZE + 200


def _may_outgrow(state: KeyState, rec: KeyedRecord, limit: int) -> bool:
    """Whether ``state`` after ``rec`` (and its alerts) might encode to over ``limit`` bytes.

    An upper bound, in O(1): one more bucket (12 bytes sparse), one more reservation, every
    open reservation reported expired, every alert line crossed, one more offset.
    """
    lines = len(state.crossings) + len(state.above) + 2 * (len(rec.thresholds) + 2)
    # Extended reservations keep one slice per bucket (two integers, brackets, commas).
    slices = sum(len(h.slices) for h in state.reservations.values())
    bound = (
        _FIXED_BYTES
        + 12 * (len(state.buckets) + 1)
        + _RES_BYTES * (len(state.reservations) + 1)
        + _ID_BYTES * (len(state.expired) + len(state.reservations) + 1)
        + _LINE_BYTES * lines
        + _OFFSET_BYTES * (len(state.offsets) + 1)
        + _SLICE_BYTES * (slices + 1)
    )
    return bound > limit


class _Origin(NamedTuple):
    """Where a per-key record came from, for its dead letter (``raw`` None: the record)."""

    raw: bytes | None
    topic: Literal["usage", "keyed"]
    partition: int
    offset: int


class _Fold:
    """The per-batch accumulator shared by both entry points."""

    def __init__(
        self, load: Load, max_value_bytes: int, redact: Callable[[bytes], bytes] | None = None
    ) -> None:
        self.load = load
        self.max_value_bytes = max_value_bytes
        self.redact = redact
        self.keys: dict[str, KeyWrite] = {}
        self.alerts: list[Alert] = []
        self.refusals: list[Refusal] = []
        self.counts = Counts()

    def refuse(self, reason: str, raw: bytes, origin: _Origin) -> None:
        if self.redact is not None:
            raw = self.redact(raw)
        self.refusals.append(Refusal(reason, raw, origin.topic, origin.partition, origin.offset))

    def account(self, rec: KeyedRecord, origin: _Origin) -> None:
        """Apply one per-key record, as the worker's account stage does per record."""
        touched = self.keys.get(rec.key)
        if touched is None:
            touched = self.keys[rec.key] = KeyWrite(rec.key, self.load(rec.key), rec.spec)
        state = touched.state
        guard = _may_outgrow(state, rec, self.max_value_bytes)
        before = state.to_bytes() if guard else b""
        change = apply(state, rec)
        due = evaluate(state, rec, change.overage) if change.outcome == "applied" else []
        if guard and change.outcome != "redelivery":
            size = len(state.to_bytes())
            if size > self.max_value_bytes:
                _restore(state, before)
                # Refused for good: its position counts as handled, so a redelivery of
                # it is a redelivery (never applied later, never dead-lettered twice).
                state.offsets[rec.src_partition] = rec.src_offset
                touched.changed = True
                self.counts.outcomes["too_large"] += 1
                self.refuse(
                    f"budget key {rec.key}: its state would be {size} bytes, over "
                    f"max_value_bytes {self.max_value_bytes}; the record was not "
                    f"applied (narrow the policy's window or widen its bucket)",
                    _record_json(rec) if origin.raw is None else origin.raw,
                    origin,
                )
                return
        self.counts.outcomes[change.outcome] += 1
        touched.changed |= change.outcome != "redelivery"
        if change.overage is not None:
            _, reserved, actual = change.overage
            touched.overage = OverageMark(ratio_milli(reserved, actual), rec.occurred_ms)
        self._mirror(touched, change, rec.spec)
        self.alerts += due

    @staticmethod
    def _mirror(touched: KeyWrite, change: Change, spec: WindowSpec) -> None:
        # What RedisMaterializer.write does per record, gathered for one write per batch.
        if change.buckets_changed or change.absorbed:
            touched.spec = spec
        touched.window_changed |= change.buckets_changed
        if change.absorbed:
            touched.absorbed[change.absorbed] = None

    def result(self, remote: list[RemoteBatch]) -> FoldResult:
        writes = [w for w in self.keys.values() if w.changed or w.redis_due]
        return FoldResult(writes, self.alerts, self.refusals, remote, self.counts)


def _restore(state: KeyState, before: bytes) -> None:
    """Put ``state`` back as ``before`` encodes it, in place (``load`` may share it)."""
    restored = KeyState.from_bytes(before)
    for name in KeyState.__slots__:
        setattr(state, name, getattr(restored, name))


def _record_json(rec: KeyedRecord) -> bytes:
    return orjson.dumps(rec.to_json())


class _Split:
    """The usage side: decode, dedupe, match, then account locally or gather remotely."""

    def __init__(
        self, fold: _Fold, rules: Rules, ids: IdStore | None, max_future_skew_ms: int
    ) -> None:
        self.fold = fold
        self.rules = rules
        self.ids = ids
        self.skew_ms = max_future_skew_ms
        self.remote: dict[tuple[int, str], tuple[Plan, list[Entry], list[int]]] = {}

    def record(self, rec: UsageRecord) -> None:
        origin = _Origin(rec.value, "usage", rec.partition, rec.offset)
        counts = self.fold.counts
        try:
            event = decode(rec.value)
            keys = self.rules.key_ids
            if keys is not None:
                subject = keys.subject(event.subject)
                if subject is not event.subject:
                    event = msgspec.structs.replace(event, subject=subject)
            matched = self.rules.index.targets(event.subject)
        except ValidationError as exc:
            self._reject(invalid_reason(exc), origin)
            return
        except SpendgateError as exc:
            self._reject(str(exc), origin)
            return
        pos = Position(rec.partition, rec.offset, rec.broker_ms)
        duplicate, settled = (
            note_ids(
                self.ids,
                pos,
                event.subject.tenant,
                event.event_id,
                event.kind,
                event.reservation_id,
            )
            if self.ids is not None
            else (False, False)
        )
        if duplicate:
            counts.duplicates += 1
            counts.events[(event.kind, "duplicate")] += 1
            return
        clamped = event.occurred_ms > rec.broker_ms + self.skew_ms
        occurred_ms = rec.broker_ms if clamped else event.occurred_ms
        counts.events[(event.kind, "counted")] += 1
        counts.clamped += clamped
        due: list[tuple[str, Plan, int]] = []
        for target in matched:
            plan = self.rules.plan(target.policy)
            try:
                due.append((target.key, plan, self._amount(plan, event)))
            except SpendgateError as exc:
                self.fold.refuse(f"policy {plan.policy.id}: {exc}", rec.value, origin)
        settled = settled and event.kind in ("reserve", "extend")
        for key, plan, amt in due:
            if plan.local:
                self.fold.account(
                    plan.terms.record(
                        key,
                        event_id=event.event_id,
                        kind=event.kind,
                        occurred_ms=occurred_ms,
                        amount=amt,
                        src_partition=rec.partition,
                        src_offset=rec.offset,
                        reservation_id=event.reservation_id,
                        expires_ms=event.expires_ms,
                        settled=settled,
                        broker_ms=rec.broker_ms,
                    ),
                    origin,
                )
                continue
            gathered = self.remote.get((rec.partition, key))
            if gathered is None:
                gathered = self.remote[(rec.partition, key)] = (plan, [], [])
            gathered[1].append(
                (
                    rec.offset,
                    event.kind,
                    occurred_ms,
                    amt,
                    event.reservation_id,
                    event.expires_ms,
                    settled,
                    event.event_id,
                )
            )
            gathered[2].append(rec.broker_ms)

    def _reject(self, reason: str, origin: _Origin) -> None:
        assert origin.raw is not None
        self.fold.counts.events[("invalid", "dead_lettered")] += 1
        self.fold.refuse(reason, origin.raw, origin)

    def _amount(self, plan: Plan, event: Event) -> int:
        if event.usage is None:
            return 0
        # The fast-decoded usage has Usage's attributes, which is all ``amount`` reads.
        usage = cast(Usage, event.usage)
        return amount(plan.policy, usage, self.rules.prices, model=event.subject.model)

    def batches(self) -> list[RemoteBatch]:
        return [
            RemoteBatch(
                key=key,
                policy=plan.terms.policy,
                window_ms=plan.terms.window_ms,
                bucket_ms=plan.terms.bucket_ms,
                boundary=plan.terms.boundary,
                limit=plan.terms.limit,
                thresholds=plan.terms.thresholds,
                src_partition=partition,
                last_offset=max(e[0] for e in entries),
                broker_ms=max(broker),
                entries=tuple(entries),
                forecast_ms=plan.terms.forecast_ms,
            )
            for (partition, key), (plan, entries, broker) in sorted(
                self.remote.items(), key=lambda item: item[0][0]
            )
        ]


def fold_usage(
    records: Sequence[UsageRecord],
    load: Load,
    rules: Rules,
    *,
    max_future_skew_ms: int,
    max_value_bytes: int,
    ids: IdStore | None = None,
) -> FoldResult:
    """Fold a batch of ``budget.usage`` records (in offset order per partition).

    Per record, as the per-record path: decode (dead letter when invalid), dedupe with
    ``ids`` (``ids.advance`` after each record, valid or not), match, derive each key's
    amount (a policy that cannot price the event dead-letters it for that policy only),
    clamp a future ``occurred_at``; then apply it to each local key, or gather it for the
    key's :class:`RemoteBatch`.

    Args:
        records: the batch.
        load: the stored state of a key the batch has not touched yet.
        rules: the policies and prices (:class:`Rules`, one per policy version).
        max_future_skew_ms: how far ``occurred_at`` may lie after the broker time.
        max_value_bytes: the largest table value; a record that would make a key's state
            larger is refused (dead letter) and changes nothing.
        ids: the dedupe set; the caller rebuilds a partition's ids first when its first
            record of the batch lies past ``ids.covered(partition) + 1``.

    Returns:
        The batch's effects (:class:`FoldResult`).
    """
    keys = rules.key_ids
    fold = _Fold(load, max_value_bytes, keys.record if keys is not None else None)
    split = _Split(fold, rules, ids, max_future_skew_ms)
    for rec in records:
        split.record(rec)
        if ids is not None:
            ids.advance(Position(rec.partition, rec.offset, rec.broker_ms))
    return fold.result(split.batches())


def fold_keyed(messages: Sequence[KeyedMessage], load: Load, *, max_value_bytes: int) -> FoldResult:
    """Fold a batch of keyed-topic messages: each entry applied and evaluated in order.

    A message that is not a :class:`RemoteBatch` is refused whole (dead letter). Entries
    at or below their key's offset for their source partition are redeliveries.

    Args:
        messages: the batch, in the keyed topic's order.
        load: the stored state of a key the batch has not touched yet.
        max_value_bytes: as in :func:`fold_usage`.

    Returns:
        The batch's effects (``remote`` is empty).
    """
    fold = _Fold(load, max_value_bytes)
    for msg in messages:
        origin = _Origin(None, "keyed", msg.partition, msg.offset)
        try:
            records = _keyed_records(msg.value)
        except ValueError as exc:
            fold.refuse(str(exc), msg.value, origin)
            continue
        for rec in records:
            fold.account(rec, origin)
    return fold.result([])


def _keyed_records(value: bytes) -> list[KeyedRecord]:
    """A keyed message's records: a :class:`RemoteBatch`, or one record as workers before
    the batch fold sent them (``KeyedRecord.to_json``), so an upgrade loses nothing.

    Raises:
        ValueError: neither; the message says why it is not a batch.
    """
    try:
        return RemoteBatch.from_bytes(value).records()
    except ValueError as exc:
        try:
            legacy = orjson.loads(value)
            if isinstance(legacy, dict) and "src_offset" in legacy:
                return [KeyedRecord.from_json(legacy)]
        except (orjson.JSONDecodeError, TypeError):
            pass
        raise exc
