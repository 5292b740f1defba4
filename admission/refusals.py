"""Publish refused admissions to ``budget.refusals`` without waiting: bounded, drops counted.

A refusal is history, not accounting: nothing waits for it, nothing retries it for long.
The admit path hands it over (:meth:`KafkaRefusals.offer`, O(1), never blocks); a
background task wakes at most once per linger (0.1 s) and sends what queued meanwhile (up
to 1,000 a pass) as one record batch per partition with ``acks=1``, never awaited on the
admit path. (Sent one by one, a refusal cost 1.42x the server CPU of a refused request
before refusals were published, at one connection; ``bench.admission_ab``.) When the
bounded buffer is full (Kafka slow or down), the refusal is dropped and counted in
``spendgate_admission_refusals_total{result="dropped"}``; ``simulate`` reports how many
were dropped, since history is incomplete there: once the publisher can send again it
publishes a :class:`schemas.refusals.RefusalGap` (how many, since when) on the same topic.
Drops at shutdown are only logged and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from datetime import UTC, datetime
from typing import Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.producer.message_accumulator import BatchBuilder

from spendgate.admission.metrics import REFUSALS
from spendgate.admission.publisher import start_producer
from spendgate.schemas.events import partition_key
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


class KafkaRefusals:
    """A bounded buffer of refusals drained to Kafka by a background task.

    Args:
        bootstrap: Kafka bootstrap servers.
        topic: the refusals topic (``{prefix}refusals``).
        buffer: refusals held at most (waiting or in flight); one more is dropped.
        retry_s: pause after a failed send or producer start.
        linger_s: how long refusals gather before they are sent together.
    """

    def __init__(
        self, bootstrap: str, topic: str, buffer: int, retry_s: float = 0.5, linger_s: float = 0.1
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.capacity = buffer
        self.retry_s = retry_s
        self.linger_s = linger_s
        self._queue: deque[Refusal] = deque()
        self._inflight = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.producer: AIOKafkaProducer | None = None
        #: Refusals dropped since the last gap record, and when the first of them was.
        self._dropped = 0
        self._dropped_since_ms = 0

    @property
    def depth(self) -> int:
        """Refusals queued or sent and not yet acknowledged."""
        return len(self._queue) + self._inflight

    def offer(self, refusal: Refusal) -> bool:
        """Queue ``refusal`` for sending; when the buffer is full drop it and count it."""
        if self.depth >= self.capacity:
            self._drop(1)
            return False
        self._queue.append(refusal)
        self._wakeup.set()
        return True

    def _drop(self, n: int) -> None:
        REFUSALS.labels(result="dropped").inc(n)
        if not self._dropped:
            self._dropped_since_ms = int(time.time() * 1000)
        self._dropped += n

    def _sent(self, future: asyncio.Future[object], n: int) -> None:
        """A batch of ``n`` refusals was answered (or failed): out of flight, counted."""
        self._inflight -= n
        if future.cancelled() or future.exception() is not None:
            self._drop(n)
        else:
            REFUSALS.labels(result="published").inc(n)

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

    async def _start(self) -> AIOKafkaProducer:
        return await start_producer(
            "refusals producer",
            self.retry_s,
            bootstrap_servers=self.bootstrap,
            acks=1,
            linger_ms=5,
            request_timeout_ms=10_000,
        )

    async def _run(self) -> None:
        self.producer = producer = await self._start()
        partitioner = DefaultPartitioner()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Let refusals gather: one wake-up and one batch per partition, however many.
            await asyncio.sleep(self.linger_s)
            if self._dropped:
                await self._send_gap(producer)
            try:
                await self._send_queued(producer, partitioner)
            except Exception as exc:  # noqa: BLE001 - not worth a retry loop: counted, go on
                logger.warning("refusals not published (%s)", exc)
                await asyncio.sleep(self.retry_s)

    async def _send_queued(
        self, producer: AIOKafkaProducer, partitioner: DefaultPartitioner
    ) -> None:
        """Send the queued refusals, one record batch per partition (more when full), at
        most :data:`PASS_RECORDS` per pass: a backlog (Kafka was away) is encoded a slice at
        a time, never in one long stall of the event loop."""
        partitions = sorted(await producer.partitions_for(self.topic))
        batches: list[tuple[int, BatchBuilder, int]] = []
        filling: dict[int, tuple[BatchBuilder, int]] = {}
        for _ in range(min(len(self._queue), PASS_RECORDS)):
            refusal = self._queue.popleft()
            self._inflight += 1
            key = partition_key(refusal.subject)
            value = refusal.model_dump_json().encode()
            partition = partitioner(key, partitions, partitions)
            batch, n = filling.get(partition) or (producer.create_batch(), 0)
            if batch.append(timestamp=None, key=key, value=value) is None:
                batches.append((partition, batch, n))
                batch, n = producer.create_batch(), 0
                batch.append(timestamp=None, key=key, value=value)
            filling[partition] = (batch, n + 1)
        batches += [(partition, batch, n) for partition, (batch, n) in filling.items()]
        for i, (partition, batch, n) in enumerate(batches):
            try:
                future = await producer.send_batch(batch, self.topic, partition=partition)
            except BaseException:
                unsent = sum(n for _, _, n in batches[i:])
                self._inflight -= unsent
                self._drop(unsent)
                raise
            future.add_done_callback(functools.partial(self._sent, n=n))

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued refusal was sent and answered; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.depth and loop.time() < deadline:  # noqa: ASYNC110 - acks arrive as callbacks
            await asyncio.sleep(0.02)
        return self.depth == 0

    async def __aenter__(self) -> KafkaRefusals:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.depth and self.producer is not None:
            await self.flush(2.0)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.producer is not None:
            try:
                await asyncio.wait_for(self.producer.stop(), 2.0)
            except TimeoutError:
                logger.warning("the refusals producer did not stop in time")
        if self.depth:
            REFUSALS.labels(result="dropped").inc(self.depth)
            logger.warning("%d refusals not published before shutdown", self.depth)
