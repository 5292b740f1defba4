"""Publish refused admissions to ``budget.refusals`` without waiting: bounded, drops counted.

A refusal is history, not accounting: nothing waits for it, nothing retries it for long.
The admit path hands it over (:meth:`KafkaRefusals.offer`, O(1), never blocks); a
background task sends it with ``acks=1`` and never awaits the ack on the admit path. When
the bounded buffer is full (Kafka slow or down), the refusal is dropped and counted in
``spendgate_admission_refusals_dropped_total``; ``simulate`` reports how many were dropped,
since history is incomplete there: once the publisher can send again it publishes a
:class:`schemas.refusals.RefusalGap` (how many, since when) on the same topic. Drops at
shutdown are only logged and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from datetime import UTC, datetime
from typing import Protocol

from aiokafka import AIOKafkaProducer

from admission.metrics import REFUSALS
from admission.publisher import start_producer
from schemas.events import partition_key
from schemas.refusals import Refusal, RefusalGap

__all__ = ["KafkaRefusals", "NoRefusals", "RefusalSink"]

logger = logging.getLogger(__name__)


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
    """

    def __init__(self, bootstrap: str, topic: str, buffer: int, retry_s: float = 0.5) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.capacity = buffer
        self.retry_s = retry_s
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

    def _done(self, future: asyncio.Future[object]) -> None:
        self._inflight -= 1
        if future.cancelled() or future.exception() is not None:
            self._drop(1)
        else:
            REFUSALS.labels(result="published").inc()

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
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self._dropped:
                await self._send_gap(producer)
            refusal = self._queue.popleft()
            self._inflight += 1
            try:
                future = await producer.send(
                    self.topic,
                    refusal.model_dump_json().encode(),
                    key=partition_key(refusal.subject),
                )
            except BaseException as exc:
                self._inflight -= 1
                if not isinstance(exc, Exception):
                    raise
                # A refusal is not worth a retry loop: drop it, count it, go on.
                self._drop(1)
                logger.warning("refusal of %s not published (%s)", refusal.request_id, exc)
                await asyncio.sleep(self.retry_s)
                continue
            future.add_done_callback(self._done)

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
