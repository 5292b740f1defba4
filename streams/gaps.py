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
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import ConsumerRecord

from spendgate.streams.kafka_util import assign, stop

__all__ = ["Positions", "committed_offset", "missing_range", "read_range"]


def missing_range(last: int | None, committed: int | None, offset: int) -> range:
    """The offsets to handle before the record at ``offset``.

    Args:
        last: the last offset this process handled on the partition (None: none since
            it was assigned).
        committed: the group's committed offset when the partition was assigned; 0 when
            the group has none (the consumer starts at the earliest record, so everything
            before ``offset`` was skipped); None when nothing is known.
        offset: the offset of the record about to be handled.

    Returns:
        ``range(start, offset)``, empty when nothing was skipped.
    """
    if last is not None:
        return range(last + 1, offset)
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


async def committed_offset(bootstrap: str, group: str, tp: TopicPartition) -> int:
    """The group's committed offset of ``tp`` (0 when it has none: the consumers start at
    the earliest record, which :func:`read_range` clamps to the log start)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        found = await admin.list_consumer_group_offsets(group, partitions=[tp])
    finally:
        await admin.close()
    meta = found.get(tp)
    return meta.offset if meta is not None and meta.offset >= 0 else 0


async def read_range(bootstrap: str, tp: TopicPartition, wanted: range) -> list[ConsumerRecord]:
    """The records of ``tp`` at the offsets in ``wanted``, in order (missing ones, such as
    transaction markers or records past retention, are simply absent)."""
    if not wanted:
        return []
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, max_poll_records=5000
    )
    await consumer.start()
    out: list[ConsumerRecord] = []
    try:
        await assign(consumer, [tp])
        begin = (await consumer.beginning_offsets([tp]))[tp]
        start = max(wanted.start, begin)
        if start >= wanted.stop:
            return []
        consumer.seek(tp, start)
        while await consumer.position(tp) < wanted.stop:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            out += [m for m in batch.get(tp, []) if m.offset < wanted.stop]
    finally:
        await stop(consumer)
    return out
