"""Records the stream skipped: find them by position and read them back, in order.

faust can deliver a partition's records with a hole, during a rebalance above all
(faust-streaming #216: "the agent gets a new event which skips offsets"). Budget keys apply
each source position once and in order (``streams.ledger``), so a skipped record that is
delivered later, or never, would be lost. Each agent therefore tracks, per partition, the
last offset it handled; a record further ahead is preceded by the records in between, read
back from Kafka and handled first (seen here: a worker given a partition during a rebalance
started 1,099 records in, on a partition the group had never committed). Records the group
had already committed were handled by a previous owner; those from the committed offset on
may or may not have been, which is safe to repeat: keys recognise what they applied by
position.

The group's committed offset alone is no proof that the records before it were applied:
faust acks the records it skips (an event of an older generation after a rebalance, or
read while the flow is suspended) without the agent seeing them, and commits them with
the others, and its commit does not wait for every changelog write it flushes (a buffer
flush that ends after 0.1 s without a send). A worker killed then leaves a commit ahead
of its table, and the next owner would resume past records no key has applied: a
``reserve`` lost that way leaves its ``commit`` to charge at its own instant (one amount
in the wrong bucket). So the table itself records, per source partition, the last offset
it applied (:func:`applied_key`, written in the same step as the key states of each
batch, in the same changelog partition after them), and a partition new to an agent is
read back from the earlier of that position and the group's commit.
"""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from spendgate.schemas import kafka_connect
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.streams.kafka_util import ReadBound, assign, stop

__all__ = [
    "APPLIED_PREFIX",
    "Positions",
    "applied_key",
    "applied_offset",
    "committed_offset",
    "is_budget_key",
    "missing_range",
    "read_range",
]

#: Table keys of the applied positions start with this; a budget key never does (it starts
#: with a policy id, ``[a-z0-9._-]``).
APPLIED_PREFIX = "~applied|"


def applied_key(topic: str, partition: int) -> str:
    """The table key holding the last offset of ``topic``'s ``partition`` whose records the
    table has applied (its value: the offset in decimal ASCII)."""
    return f"{APPLIED_PREFIX}{topic}|{partition}"


def is_budget_key(key: str) -> bool:
    """Whether a table key is a budget key's state, not one of the worker's own records (an
    applied position, ``streams.unsent``'s alerts: their keys start with ``~``, which a
    policy id never does)."""
    return not key.startswith("~")


def applied_offset(table: Any, topic: str, partition: int) -> int | None:
    """The last offset of ``topic``'s ``partition`` the table has applied (None: unknown,
    a table written before positions were kept or a partition never applied)."""
    raw = table.get(applied_key(topic, partition))
    return int(raw) if raw else None


def missing_range(
    last: int | None, committed: int | None, offset: int, applied: int | None = None
) -> range:
    """The offsets to handle before the record at ``offset``.

    Args:
        last: the last offset this process handled on the partition (None: none since
            it was assigned).
        committed: the group's committed offset when the partition was assigned; 0 when
            the group has none (the consumer starts at the earliest record, so everything
            before ``offset`` was skipped); None when nothing is known.
        offset: the offset of the record about to be handled.
        applied: the last offset the table has applied (:func:`applied_offset`; None:
            unknown). A commit ahead of it (faust committed records the table never got)
            is not trusted: everything after it is read back.

    Returns:
        ``range(start, offset)``, empty when nothing was skipped.
    """
    if last is not None:
        return range(last + 1, offset)
    if applied is not None and (committed is None or applied + 1 < committed):
        committed = applied + 1
    if committed is None:
        return range(offset, offset)
    return range(min(committed, offset), offset)


class Positions:
    """The last offset handled per partition, forgotten when a partition is reassigned."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}

    def last(self, partition: int) -> int | None:
        """The last offset handled on ``partition`` since it was assigned, if any."""
        return self._last.get(partition)

    def handled(self, partition: int, offset: int) -> None:
        """Record that ``offset`` was handled (offsets only move forward)."""
        if offset > self._last.get(partition, -1):
            self._last[partition] = offset

    def forget(self) -> None:
        """Forget every partition (after a rebalance)."""
        self._last.clear()


async def committed_offset(
    kafka: KafkaConnection, group: str, tp: TopicPartition, bound: ReadBound | None = None
) -> int:
    """The group's committed offset of ``tp`` (0 when it has none: the consumers start at
    the earliest record, which :func:`read_range` clamps to the log start).

    Raises:
        KafkaWaitExpired: a step took longer than ``bound``.
    """
    bound = bound or ReadBound(None)
    what = f"asking the committed offset of {tp.topic}[{tp.partition}]"
    admin = kafka_connect.admin(kafka)
    try:
        await bound.step(what, admin.start())
        found = await bound.step(what, admin.list_consumer_group_offsets(group, partitions=[tp]))
    finally:
        await admin.close()
    meta = found.get(tp)
    return meta.offset if meta is not None and meta.offset >= 0 else 0


async def read_range(
    kafka: KafkaConnection, tp: TopicPartition, wanted: range, bound: ReadBound | None = None
) -> list[ConsumerRecord]:
    """The records of ``tp`` at the offsets in ``wanted``, in order (missing ones, such as
    transaction markers or records past retention, are simply absent).

    Raises:
        KafkaWaitExpired: a step, or the next record, took longer than ``bound``.
    """
    if not wanted:
        return []
    bound = bound or ReadBound(None)
    what = f"reading back {tp.topic}[{tp.partition}]"
    consumer = kafka_connect.consumer(kafka, enable_auto_commit=False, max_poll_records=5000)
    out: list[ConsumerRecord] = []
    try:
        await bound.step(what, consumer.start())
        await bound.step(what, assign(consumer, [tp]))
        begin = (await bound.step(what, consumer.beginning_offsets([tp])))[tp]
        start = max(wanted.start, begin)
        if start >= wanted.stop:
            return []
        consumer.seek(tp, start)
        while await bound.step(what, consumer.position(tp)) < wanted.stop:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            got = batch.get(tp, [])
            bound.read(len(got), what)
            out += [m for m in got if m.offset < wanted.stop]
    finally:
        await stop(consumer)
    return out
