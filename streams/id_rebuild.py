"""Rebuild a partition's dedupe ids by re-reading the last horizon of ``usage``."""

from __future__ import annotations

import logging

from aiokafka import TopicPartition
from pydantic import ValidationError

from spendgate.schemas import kafka_connect
from spendgate.schemas.events import parse_event
from spendgate.schemas.exceptions import SpendgateError
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.streams import metrics
from spendgate.streams.dedupe import IdStore, Position
from spendgate.streams.ids import note
from spendgate.streams.kafka_util import ReadBound, assign, stop

logger = logging.getLogger(__name__)


def remember_raw(ids: IdStore, pos: Position, raw: bytes) -> None:
    """Note one raw usage record in ``ids`` exactly as the live path would."""
    try:
        event = parse_event(raw)
    except (ValidationError, SpendgateError):
        event = None
    if event is not None:
        note(ids, pos, event)
    ids.advance(pos)


async def rebuild_ids(
    kafka: KafkaConnection,
    topic: str,
    ids: IdStore,
    resume: Position,
    bound: ReadBound | None = None,
) -> int:
    """Fill ``ids`` for ``resume.partition`` with the records before ``resume.offset``.

    Reads from the later of (the first offset not yet covered locally) and (the first
    record that arrived within the horizon before ``resume``), up to ``resume.offset``
    (exclusive). Nothing is read when the local set already covers it.

    Returns:
        The number of records re-read.

    Raises:
        KafkaWaitExpired: a step, or the next record, took longer than ``bound``.
    """
    start = ids.covered(resume.partition) + 1
    if start >= resume.offset:
        return 0
    bound = bound or ReadBound(None)
    what = f"rebuilding the dedupe ids of {topic}[{resume.partition}]"
    tp = TopicPartition(topic, resume.partition)
    consumer = kafka_connect.consumer(kafka, enable_auto_commit=False, max_poll_records=5000)
    read = 0
    try:
        await bound.step(what, consumer.start())
        await bound.step(what, assign(consumer, [tp]))
        since = max(0, resume.arrival_ms - ids.horizon_ms)
        found = (await bound.step(what, consumer.offsets_for_times({tp: since})))[tp]
        first = found.offset if found is not None else resume.offset
        begin = (await bound.step(what, consumer.beginning_offsets([tp])))[tp]
        start = max(start, first, begin)
        if start >= resume.offset:
            return 0
        logger.info(
            "rebuilding dedupe ids of %s[%d] from offset %d to %d",
            topic,
            resume.partition,
            start,
            resume.offset,
        )
        consumer.seek(tp, start)
        done = False
        while not done:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            bound.read(len(batch.get(tp, [])), what)
            for msg in batch.get(tp, []):
                if msg.offset >= resume.offset:
                    done = True
                    break
                pos = Position(msg.partition, msg.offset, msg.timestamp)
                remember_raw(ids, pos, msg.value or b"")
                read += 1
                if msg.offset + 1 >= resume.offset:
                    done = True
            # Offsets with no record (transaction markers) end the read by position.
            if not done and await bound.step(what, consumer.position(tp)) >= resume.offset:
                done = True
    finally:
        await stop(consumer)
    metrics.DEDUPE_REBUILT.inc(read)
    ids.save()
    return read
