"""One batch's commit in steps: fold, table writes, changelog, Redis with marks, sends, offsets.

:class:`BatchCommit` runs the steps in the order that keeps the worker's guarantees
(exactly-once effects through a crash, marks never ahead of the windows they vouch for)
over the :class:`StateTable`, :class:`RedisWriter`, :class:`MarkKeeper`, :class:`Outbox`
and :class:`OffsetCommitter` it is given: faust's table, the Redis materializer and faust's
topics and stream in the worker (``streams.faust_io``), in-memory stand-ins in its tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Container, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from spendgate.schemas.alerts import Alert
from spendgate.streams.effects import FoldResult, KeyWrite, Refusal
from spendgate.streams.exceptions import KafkaWait, KafkaWaitExpired
from spendgate.streams.remote import RemoteBatch
from spendgate.streams.scripts.mark import MarkReply, MarkWrite

__all__ = [
    "BatchCommit",
    "Carried",
    "Folded",
    "Last",
    "MarkKeeper",
    "OffsetCommitter",
    "Outbox",
    "PartitionFold",
    "RedisWriter",
    "StateTable",
    "by_partition",
    "drop_carried",
]

T = TypeVar("T")


class Last(NamedTuple):
    """The last record a batch applied of one partition: where, and its broker ms."""

    topic: str
    partition: int
    offset: int
    broker_ms: int


class Folded(NamedTuple):
    """One partition's part of a batch: its fold and its last record."""

    partition: int
    result: FoldResult
    last: Last


class Carried(NamedTuple):
    """A table write Redis may not have (its batch failed before step 4 confirmed it),
    with the source partition whose records made it (the table partition it lives in)."""

    partition: int
    write: KeyWrite


#: Folds one partition's events of a batch (reading back records the stream skipped first).
PartitionFold = Callable[[int, Sequence[Any]], Awaitable[tuple[FoldResult, Last]]]


class StateTable(Protocol):
    """The key-state table (faust's, changelogged)."""

    def write(
        self, events: Sequence[Any], writes: Sequence[KeyWrite], alerts: Sequence[Alert] = ()
    ) -> None:
        """Write the changed keys of one partition's fold, and the ``alerts`` it raised
        beside those the partition kept unsent (``streams.unsent``); ``events`` are that
        partition's (a table write goes to the changelog partition of its event), no
        await inside."""

    def unsent(self, events: Sequence[Any]) -> list[Alert]:
        """The alerts kept unsent for the partition of ``events``."""

    def sent(self, events: Sequence[Any], alert_ids: Iterable[str]) -> None:
        """The broker acked ``alert_ids``: no longer kept for the partition of
        ``events``."""

    def forget(self) -> None:
        """Drop every cached state: a batch failed half-way, read the table again."""


class RedisWriter(Protocol):
    """Redis as the fold mirrors it (``streams.materialize.RedisMaterializer``)."""

    async def write_batch(
        self, writes: Sequence[KeyWrite], marks: Sequence[MarkWrite] = (), presence: str = ""
    ) -> MarkReply | None:
        """The batch's windows in one pipeline, then, once every window step succeeded,
        its marks."""

    async def write_marks(self, marks: Sequence[MarkWrite], presence: str) -> MarkReply:
        """Marks alone (fenced)."""


class MarkKeeper(Protocol):
    """The marks bookkeeping (``streams.keeper.RedisKeeper``)."""

    @property
    def presence(self) -> str:
        """This worker's presence key, written with every mark."""

    def advance(self, lasts: Iterable[Last]) -> list[MarkWrite]:
        """The marks a batch that applied up to ``lasts`` advances, changing nothing: a
        Redis step that fails leaves the bookkeeping as it was."""

    def advanced(self, lasts: Iterable[Last], marks: Iterable[MarkWrite]) -> None:
        """Redis has what the batch applied up to ``lasts``, and ``marks`` (from
        :meth:`advance`) were sent with it: note the positions and claims."""

    def noted(self, reply: MarkReply | None) -> None:
        """Act on the mark script's reply (a loss of Redis data, fenced writes)."""


class Outbox(Protocol):
    """What a batch sends on; each call returns the broker's ack to await."""

    async def keyed(self, batch: RemoteBatch) -> Awaitable[Any]:
        """A keyed batch (keys spanning tenants)."""

    async def dead_letter(self, refusal: Refusal) -> Awaitable[Any]:
        """A refused record."""

    async def alert(self, alert: Alert) -> Awaitable[Any]:
        """An alert."""


class OffsetCommitter(Protocol):
    """The source offsets (faust's stream acks)."""

    async def commit(self, events: Sequence[Any]) -> None:
        """Mark ``events`` processed. faust flushes its producer (the changelog) before it
        commits an acked offset to the group."""


class BatchCommit:
    """Commits one batch of one topic's events, partition by partition, in numbered steps.

    1. **fold** each partition's records (``fold``: read back what the stream skipped,
       rebuild dedupe ids, fold);
    2. **table writes**: that partition's changed keys, at once after its fold (the
       table's cached states as new as the table; the keys marked in flight to Redis),
       then the last offset they applied (``streams.gaps.applied_key``): a partition new
       to an agent is read back from there when the group's commit ran ahead of it;
    3. **changelog**: each table write queued its changelog record on faust's producer
       buffer; step 6 acks only once that buffer handed them to the producer, and faust
       flushes the producer before it commits an acked offset, so the changelog is never
       behind the offsets. Nothing is awaited here: a crash before step 6 folds the
       batch again from the table, where its records are redeliveries (applied once,
       never twice);
    4. **Redis with marks**: one pipeline for the whole batch: windows, absorbed
       reservations, overage marks; then, once every one of them succeeded, the marks the
       batch advanced, unless it sent keyed batches (a usage mark vouches for those only
       once the broker has them);
    5. **sends**: keyed batches, dead letters and alerts (alerts only once the state is in
       the table and in Redis; with them every alert an earlier batch could not get acked),
       every broker ack awaited; then the marks held back in 4;
    6. **offsets**: the batch counted and its positions noted (``done``), then every event
       acked (``streams.faust_io.StreamAcks``: once the changelog writes left faust's
       buffer).

    Steps 5 and 6 wait on Kafka, each within ``kafka_wait_s``: past it the step raises
    :class:`~streams.exceptions.KafkaWaitExpired` (the sends themselves are left to the
    producer, never cancelled) and the caller commits the batch again
    (``streams.retry.commit_until_written``): its records are then redeliveries, its keyed
    batches and alerts are sent again, and their receivers recognise them by position and
    by id.

    Any failure before 6 leaves the offsets uncommitted, drops the cached states and
    raises: the records come again, and the table applies them once. What steps 2 wrote
    but step 4 did not confirm is carried to the next batch's step 4, merged into that
    batch's write of the same key: a redelivery rewrites its key's window and absorbs
    again (``streams.ledger.Change.buckets_changed``), but brings no overage mark. Each
    carried write keeps its source partition: the worker drops those of partitions it no
    longer owns (:func:`drop_carried`).

    Alerts are at least once: an alert is kept as unsent from the table write that records
    its crossing (step 2, in the table too: ``streams.unsent``) until the broker acked it,
    and every batch's step 5 sends the unsent ones again (a failed batch's records come
    again as redeliveries, which raise none). A process that died in between leaves them
    in the table: the partition's next batch, here or on the worker that took it over,
    finds them in step 2 and sends them. Their ids are deterministic, so a consumer drops
    a second copy by id.

    Step 4 writes the marks only once every window step of the batch succeeded
    (``streams.materialize.RedisMaterializer.write_batch``): a mark never vouches for a
    window Redis did not take.

    Args:
        fold: folds one partition's events.
        table: the key-state table.
        redis: Redis (windows and marks).
        marks: the marks bookkeeping.
        outbox: what the batch sends on.
        offsets: the source offsets.
        in_flight: keys whose table value is newer than Redis until step 4 (shared with
            the drift check: not drift).
        done: called with the batch's partitions once it is written and sent.
        unmirrored: the carried writes by key (kept by the caller across commits: a
            restarted agent makes a new commit; the caller drops those of partitions it
            no longer owns, :func:`drop_carried`).
        unsent: the alerts not acked yet by id (kept by the caller across commits, like
            ``unmirrored``; kept whoever owns their partition now: the new owner's
            redeliveries raise none).
        kafka_wait_s: the bound on each of steps 5 and 6 (None: unbounded, tests only).
    """

    def __init__(
        self,
        fold: PartitionFold,
        table: StateTable,
        redis: RedisWriter,
        marks: MarkKeeper,
        outbox: Outbox,
        offsets: OffsetCommitter,
        *,
        in_flight: set[str] | None = None,
        done: Callable[[Sequence[Folded]], None] | None = None,
        unmirrored: dict[str, Carried] | None = None,
        unsent: dict[str, Alert] | None = None,
        kafka_wait_s: float | None = None,
    ) -> None:
        self.fold = fold
        self.table = table
        self.redis = redis
        self.marks = marks
        self.outbox = outbox
        self.offsets = offsets
        self.in_flight = in_flight if in_flight is not None else set()
        self.done = done
        #: Key writes in the table that Redis may not have (a batch failed before step 4
        #: confirmed them): written with the next batch's windows.
        self.unmirrored = unmirrored if unmirrored is not None else {}
        #: Alerts whose crossing is in the table and that the broker has not acked yet:
        #: sent with every batch until it has.
        self.unsent = unsent if unsent is not None else {}
        self.kafka_wait_s = kafka_wait_s

    async def run(self, events: Sequence[Any]) -> list[Folded]:
        """Commit ``events`` (faust events of one topic, any partitions) in steps 1-6.

        Returns:
            Each partition's part of the batch, in order of first appearance.
        """
        touched: set[str] = set()
        written: list[Carried] = []
        parts: list[Folded] = []
        groups: dict[int, Sequence[Any]] = {}
        try:
            for partition, group in by_partition(events).items():
                # 1. fold
                result, last = await self.fold(partition, group)
                # 2. table writes (no await until the keys are marked in flight), with the
                # alerts this partition kept unsent (a process that died before their ack)
                written += [Carried(partition, w) for w in result.writes]
                self.unsent.update((a.alert_id, a) for a in self.table.unsent(group))
                self.table.write(group, result.writes, result.alerts)
                self.unsent.update((a.alert_id, a) for a in result.alerts)
                groups[partition] = group
                keys = {w.key for w in result.writes}
                self.in_flight.update(keys)
                touched |= keys
                # 3. changelog: queued by step 2; flushed by faust before step 6's commit.
                parts.append(Folded(partition, result, last))
            await self._redis(parts, touched)
            written = []  # in Redis now
            await self._within("sends", self._sends(parts, groups))
            if self.done is not None:
                self.done(parts)
        except BaseException:
            self._carry(written)
            self.table.forget()
            self.in_flight.difference_update(touched)
            raise
        # 6. offsets
        await self._within("offsets", self.offsets.commit(events))
        return parts

    async def _within(self, wait: KafkaWait, step: Awaitable[T]) -> T:
        """``step`` within ``kafka_wait_s``.

        Raises:
            KafkaWaitExpired: it did not finish in time (a step's own TimeoutError too).
        """
        if self.kafka_wait_s is None:
            return await step
        try:
            async with asyncio.timeout(self.kafka_wait_s):
                return await step
        except TimeoutError:
            what = {"sends": "the batch's sends", "offsets": "the batch's changelog writes"}
            raise KafkaWaitExpired(
                wait,
                f"{what.get(wait, wait)} not done within {self.kafka_wait_s} s "
                "(SPENDGATE_WORKER_KAFKA_WAIT_S)",
            ) from None

    async def _redis(self, parts: Sequence[Folded], touched: set[str]) -> None:
        """Step 4: the batch's windows (and those carried from a failed batch) and, unless
        it sent keyed batches, its marks once every window step succeeded."""
        due = self._with_unmirrored([w for part in parts for w in part.result.writes])
        try:
            later = any(part.result.remote for part in parts)
            lasts = [part.last for part in parts]
            marks = [] if later else self.marks.advance(lasts)
            reply = await self.redis.write_batch(due, marks, self.marks.presence)
            self.unmirrored.clear()
            if not later:
                # Only now: noted before, a failed write would leave the idle marks
                # vouching for windows Redis lacks.
                self.marks.advanced(lasts, marks)
        finally:
            self.in_flight.difference_update(touched)
        self.marks.noted(reply)

    async def _sends(self, parts: Sequence[Folded], groups: dict[int, Sequence[Any]]) -> None:
        """Step 5: keyed batches, dead letters, then every unsent alert (this batch's and
        those an earlier batch could not get acked); every ack awaited (nothing is lost
        in a crash), the acked alerts no longer kept in the table; then the marks step 4
        held back."""
        sent: list[Awaitable[Any]] = []
        for part in parts:
            sent += [await self.outbox.keyed(b) for b in part.result.remote]
            sent += [await self.outbox.dead_letter(r) for r in part.result.refusals]
        alerts = list(self.unsent.values())
        sent += [await self.outbox.alert(a) for a in alerts]
        await _acked(sent)
        for alert in alerts:
            self.unsent.pop(alert.alert_id, None)
        acked = [a.alert_id for a in alerts]
        for group in groups.values():
            self.table.sent(group, acked)
        if any(part.result.remote for part in parts):
            lasts = [part.last for part in parts]
            marks = self.marks.advance(lasts)
            reply = await self.redis.write_marks(marks, self.marks.presence)
            self.marks.advanced(lasts, marks)
            self.marks.noted(reply)

    def _carry(self, written: Sequence[Carried]) -> None:
        """Keep ``written`` (in the table, maybe not in Redis) for the next step 4."""
        for carried in written:
            w = carried.write
            if (older := self.unmirrored.get(w.key)) is not None:
                _merge(w, older.write)
            self.unmirrored[w.key] = carried

    def _with_unmirrored(self, writes: list[KeyWrite]) -> list[KeyWrite]:
        """Step 4's writes: the carried ones, each merged into this batch's write of its key
        (the newer state; whether or not this batch changed the key's window), else as
        they were; then this batch's, those Redis needs."""
        carried = []
        if self.unmirrored:
            mine = {w.key: w for w in writes}
            for key, (_, older) in self.unmirrored.items():
                if (w := mine.get(key)) is not None:
                    _merge(w, older)
                elif older.redis_due:
                    carried.append(older)
        return carried + [w for w in writes if w.redis_due]


async def _acked(sent: Sequence[Awaitable[Any]]) -> None:
    """Wait for every ack of ``sent``; raise the first error among them.

    A bound cancelling this wait leaves the sends to the producer (``asyncio.wait`` never
    cancels what it waits for, where ``gather`` would cancel the message futures faust and
    aiokafka still resolve).
    """
    if not sent:
        return
    futures = [asyncio.ensure_future(a) for a in sent]
    await asyncio.wait(futures)
    # Every error retrieved (none left to be logged as never retrieved), the first raised.
    errors = [exc for fut in futures if (exc := fut.exception()) is not None]
    if errors:
        raise errors[0]


def _merge(newer: KeyWrite, older: KeyWrite) -> None:
    """Fold ``older``'s unconfirmed Redis write of the same key into ``newer``'s."""
    newer.window_changed |= older.window_changed
    newer.absorbed = {**older.absorbed, **newer.absorbed}
    if newer.overage is None:
        newer.overage = older.overage


def drop_carried(unmirrored: dict[str, Carried], owned: Container[int]) -> int:
    """Drop from ``unmirrored`` the carried writes of partitions not in ``owned``.

    A partition that moved to another worker is restored there from the changelog; a
    carried write sent later would overwrite what its new owner wrote since (an overage
    mark is set without a version check).

    Returns:
        How many carried writes were dropped.
    """
    gone = [key for key, carried in unmirrored.items() if carried.partition not in owned]
    for key in gone:
        del unmirrored[key]
    return len(gone)


def by_partition(events: Sequence[Any]) -> dict[int, list[Any]]:
    """``events`` grouped by partition, each group in arrival (offset) order."""
    out: dict[int, list[Any]] = {}
    for event in events:
        out.setdefault(event.message.partition, []).append(event)
    return out
