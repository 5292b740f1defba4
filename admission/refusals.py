"""Publish refused admissions to ``budget.refusals`` without waiting: bounded, drops counted.

A refusal is history, not accounting: nothing waits for it, nothing retries it for long.
The admit path hands it over (:meth:`KafkaRefusals.offer`, O(1), never blocks); the
background sender (:class:`~spendgate.admission.outbound.BoundedProducer`'s, woken by an
event) lingers 0.1 s and sends what queued meanwhile (up to 1,000 a pass) as one record
batch per partition with ``acks=1``, never awaited on the admit path. (Sent one by one, a
refusal cost 1.42x the server CPU of a refused request before refusals were published, at
one connection; ``bench.admission_ab``.) When the bounded buffer is full (Kafka slow or
down), the refusal is dropped and counted in
``spendgate_admission_refusals_total{result="dropped"}``; ``simulate`` reports how many
were dropped, since history is incomplete there: once the publisher can send again it
publishes a :class:`schemas.refusals.RefusalGap` (how many, since when) on the same topic.
Drops at shutdown are only logged and counted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from datetime import UTC, datetime
from typing import Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.producer.message_accumulator import BatchBuilder

from spendgate.admission.metrics import REFUSALS
from spendgate.admission.outbound import BoundedProducer
from spendgate.schemas.events import partition_key
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.refusals import Refusal, RefusalGap

__all__ = ["KafkaRefusals", "NoRefusals", "RefusalSink"]

logger = logging.getLogger(__name__)

#: Refusals encoded and sent per pass of the background task (about 10 ms of work).
PASS_RECORDS = 1_000


class RefusalSink(Protocol):
    """Where admission hands every refusal; never blocks, never raises."""

    def offer(self, refusal: Refusal) -> bool:
        """Queue one refusal; False (and counted) when it was dropped."""
        ...


class NoRefusals:
    """A sink that keeps nothing (refusals are not published)."""

    def offer(self, refusal: Refusal) -> bool:
        """Drop ``refusal`` silently: publishing refusals is off."""
        return False


class KafkaRefusals(BoundedProducer[Refusal]):
    """A bounded buffer of refusals drained to Kafka by a background task.

    Args:
        kafka: how to reach Kafka.
        topic: the refusals topic (``{prefix}refusals``).
        buffer: refusals held at most (waiting or in flight); one more is dropped.
        retry_s: pause after a failed send or producer start.
        linger_s: how long refusals gather before they are sent together.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        topic: str,
        buffer: int,
        retry_s: float = 0.5,
        linger_s: float = 0.1,
    ) -> None:
        super().__init__(
            "refusals producer",
            kafka,
            topic,
            buffer,
            retry_s=retry_s,
            linger_s=linger_s,
            acks=1,
            linger_ms=5,
            request_timeout_ms=10_000,
        )
        self._partitioner = DefaultPartitioner()
        #: Refusals dropped since the last gap record, and when the first of them was.
        self._dropped = 0
        self._dropped_since_ms = 0

    def offer(self, refusal: Refusal) -> bool:
        """Queue ``refusal`` for sending; when the buffer is full drop it and count it."""
        if self._accept(refusal):
            return True
        self._drop(1)
        return False

    def _drop(self, n: int) -> None:
        REFUSALS.labels(result="dropped").inc(n)
        if not self._dropped:
            self._dropped_since_ms = int(time.time() * 1000)
        self._dropped += n

    def _sent(self, future: asyncio.Future[object], seqs: list[int]) -> None:
        """A batch of refusals was answered (or failed): settled, and counted."""
        self._settle(seqs)
        if future.cancelled() or future.exception() is not None:
            self._drop(len(seqs))
        else:
            REFUSALS.labels(result="published").inc(len(seqs))

    async def _send_gap(self, producer: AIOKafkaProducer) -> None:
        """Say on the topic how many refusals were dropped since when (best effort)."""
        n, since_ms = self._dropped, self._dropped_since_ms
        gap = RefusalGap(
            dropped=n,
            since=datetime.fromtimestamp(since_ms / 1000, UTC),
            until=datetime.now(UTC),
        )
        self._dropped = 0
        try:
            await producer.send(self.topic, gap.model_dump_json().encode(), key=b"_")
        except Exception as exc:  # noqa: BLE001 - counted again, said on the next try
            logger.warning("refusal gap record not published (%s)", exc)
            self._dropped += n
            self._dropped_since_ms = since_ms

    async def _send_queued(self, producer: AIOKafkaProducer) -> None:
        """Send the queued refusals, one record batch per partition (more when full), at
        most :data:`PASS_RECORDS` per pass: a backlog (Kafka was away) is encoded a slice at
        a time, never in one long stall of the event loop. A gap record, when refusals were
        dropped since the last one, goes first. A failed send drops (and counts) what it
        had not sent: not worth a retry loop."""
        if self._dropped:
            await self._send_gap(producer)
        partitions = sorted(await producer.partitions_for(self.topic))
        batches: list[tuple[int, BatchBuilder, list[int]]] = []
        filling: dict[int, tuple[BatchBuilder, list[int]]] = {}
        for seq, refusal in self._take(PASS_RECORDS):
            key = partition_key(refusal.subject)
            value = refusal.model_dump_json().encode()
            partition = self._partitioner(key, partitions, partitions)
            batch, seqs = filling.get(partition) or (producer.create_batch(), [])
            if batch.append(timestamp=None, key=key, value=value) is None:
                batches.append((partition, batch, seqs))
                batch, seqs = producer.create_batch(), []
                batch.append(timestamp=None, key=key, value=value)
            seqs.append(seq)
            filling[partition] = (batch, seqs)
        batches += [(partition, batch, seqs) for partition, (batch, seqs) in filling.items()]
        for i, (partition, batch, seqs) in enumerate(batches):
            try:
                future = await producer.send_batch(batch, self.topic, partition=partition)
            except BaseException:
                unsent = [seq for _, _, rest in batches[i:] for seq in rest]
                self._settle(unsent)
                self._drop(len(unsent))
                raise
            future.add_done_callback(functools.partial(self._sent, seqs=seqs))

    async def __aexit__(self, *exc: object) -> None:
        # Waiting for a broker never reached would only delay the shutdown.
        await self._close(2.0 if self.producer is not None else 0.0, stop_s=2.0)
        if self.depth:
            REFUSALS.labels(result="dropped").inc(self.depth)
            logger.warning("%d refusals not published before shutdown", self.depth)
