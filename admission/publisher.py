"""Publish usage events to Kafka without making the caller wait for acks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Protocol

from aiokafka import AIOKafkaProducer

from admission.metrics import PUBLISH_BUFFER, PUBLISH_RETRIES
from schemas.events import UsageEvent, partition_key

logger = logging.getLogger(__name__)


class UsagePublisher(Protocol):
    """Where admission sends ``reserve``, ``commit`` and ``release`` events."""

    def has_room(self) -> bool:
        """Whether one more event fits in the buffer."""
        ...

    def publish(self, event: UsageEvent) -> bool:
        """Queue one event; False when the bounded buffer is full."""
        ...


class KafkaPublisher:
    """An idempotent aiokafka producer fed from a bounded in-memory buffer.

    ``publish`` never waits: the event joins the buffer and a background task sends it.
    An event counts against the bound from ``publish`` until the broker acks it; a send
    that fails (broker down, timeout) puts the event back at the head of the buffer and
    is retried with backoff, so nothing accepted is dropped while the process lives. The
    producer itself is (re)started in the background, so the service starts and answers
    even while Kafka is down.
    """

    def __init__(self, bootstrap: str, topic: str, buffer: int, retry_s: float = 0.5) -> None:
        self.topic = topic
        self.bootstrap = bootstrap
        self.capacity = buffer
        self.retry_s = retry_s
        self.producer: AIOKafkaProducer | None = None
        self._queue: deque[UsageEvent] = deque()
        self._inflight = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.connected = False

    @property
    def depth(self) -> int:
        """Events accepted and not yet acked."""
        return len(self._queue) + self._inflight

    def has_room(self) -> bool:
        """Whether one more event fits in the buffer."""
        return self.depth < self.capacity

    def publish(self, event: UsageEvent) -> bool:
        """Queue one event for sending; False when the buffer is full."""
        if not self.has_room():
            return False
        self._queue.append(event)
        PUBLISH_BUFFER.set(self.depth)
        self._wakeup.set()
        return True

    def _acked(self, event: UsageEvent, future: asyncio.Future[object]) -> None:
        self._inflight -= 1
        if future.cancelled() or future.exception() is not None:
            PUBLISH_RETRIES.inc()
            logger.warning("publishing %s failed; will retry", event.event_id)
            self._queue.appendleft(event)
            self._wakeup.set()
        PUBLISH_BUFFER.set(self.depth)

    async def _start_producer(self) -> AIOKafkaProducer:
        while True:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap,
                enable_idempotence=True,
                linger_ms=2,
                request_timeout_ms=10_000,
            )
            try:
                await producer.start()
            except Exception as exc:  # noqa: BLE001 - any start failure: retry later
                logger.warning("Kafka producer cannot start (%s); retrying", exc)
                with contextlib.suppress(Exception):
                    await producer.stop()
                await asyncio.sleep(self.retry_s)
                continue
            self.connected = True
            return producer

    async def _run(self) -> None:
        self.producer = await self._start_producer()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            event = self._queue.popleft()
            self._inflight += 1
            try:
                future = await self.producer.send(
                    self.topic,
                    event.model_dump_json().encode(),
                    key=partition_key(event.subject),
                )
            except Exception as exc:  # noqa: BLE001 - retried, never dropped
                self._inflight -= 1
                self._queue.appendleft(event)
                PUBLISH_RETRIES.inc()
                logger.warning("queueing %s failed (%s); retrying", event.event_id, exc)
                await asyncio.sleep(self.retry_s)
                continue
            future.add_done_callback(lambda f, e=event: self._acked(e, f))

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every accepted event is acked; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.depth and loop.time() < deadline:  # noqa: ASYNC110 - acks arrive as callbacks
            await asyncio.sleep(0.02)
        return self.depth == 0

    async def __aenter__(self) -> KafkaPublisher:
        # aiokafka binds to the running loop, so the producer is made in the task.
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.connected:
            await self.flush()
        if self.depth:
            logger.error("%d events were not published before shutdown", self.depth)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.producer is not None:
            await self.producer.stop()
