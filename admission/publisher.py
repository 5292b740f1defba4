"""Publish usage events to Kafka without making the caller wait for acks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from aiokafka import AIOKafkaProducer

from schemas.events import UsageEvent, partition_key

logger = logging.getLogger(__name__)


class UsagePublisher(Protocol):
    """Where admission sends ``reserve``, ``commit`` and ``release`` events."""

    def publish(self, event: UsageEvent) -> bool:
        """Queue one event; False when the bounded buffer is full."""
        ...


class KafkaPublisher:
    """An idempotent aiokafka producer fed from a bounded in-memory buffer."""

    def __init__(self, bootstrap: str, topic: str, buffer: int) -> None:
        self.topic = topic
        self.queue: asyncio.Queue[UsageEvent] = asyncio.Queue(maxsize=buffer)
        self.bootstrap = bootstrap
        self.producer: AIOKafkaProducer | None = None
        self._task: asyncio.Task[None] | None = None

    def publish(self, event: UsageEvent) -> bool:
        """Queue one event for sending; False when the buffer is full."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            return False
        return True

    async def _drain(self) -> None:
        while True:
            event = await self.queue.get()
            while True:
                try:
                    assert self.producer is not None
                    await self.producer.send(
                        self.topic,
                        event.model_dump_json().encode(),
                        key=partition_key(event.subject),
                    )
                    break
                except Exception:
                    logger.exception("publishing %s failed; retrying", event.event_id)
                    await asyncio.sleep(0.5)

    async def __aenter__(self) -> KafkaPublisher:
        # aiokafka binds to the running loop, so the producer is made here, not in __init__.
        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, enable_idempotence=True, linger_ms=2
        )
        await self.producer.start()
        self._task = asyncio.create_task(self._drain())
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Give queued events a moment to leave before closing.
        for _ in range(50):
            if self.queue.empty():
                break
            await asyncio.sleep(0.1)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.producer is not None:
            await self.producer.stop()
