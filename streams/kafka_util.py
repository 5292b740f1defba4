"""Small aiokafka helpers shared by the replay, the alert feed and the tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition

from spendgate.schemas import kafka_connect
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.streams.exceptions import KafkaWaitExpired

T = TypeVar("T")


class ReadBound:
    """The bound on a read back from Kafka: each step (start, assign, offsets) within
    ``wait_s``, and records arriving at least every ``wait_s`` while more are expected
    (a long read that keeps reading is no stall); each record batch read is progress.

    Args:
        wait_s: the bound (``SPENDGATE_WORKER_KAFKA_WAIT_S``; None: unbounded).
        progressed: called with each batch of records read (the agent's liveness).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        wait_s: float | None,
        progressed: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wait_s = wait_s
        self.progressed = progressed
        self.clock = clock
        self._last = clock()

    def _expired(self, what: str) -> KafkaWaitExpired:
        return KafkaWaitExpired(
            "read_back",
            f"{what} not done within {self.wait_s} s (SPENDGATE_WORKER_KAFKA_WAIT_S)",
        )

    async def step(self, what: str, aw: Awaitable[T]) -> T:
        """``aw`` within the bound.

        Raises:
            KafkaWaitExpired: it did not finish in time.
        """
        if self.wait_s is None:
            return await aw
        try:
            async with asyncio.timeout(self.wait_s):
                result = await aw
        except TimeoutError:
            raise self._expired(what) from None
        self._last = self.clock()
        return result

    def read(self, records: int, what: str) -> None:
        """``records`` arrived (0: none this poll).

        Raises:
            KafkaWaitExpired: none arrived for longer than the bound.
        """
        now = self.clock()
        if records:
            self._last = now
            if self.progressed is not None:
                self.progressed()
        elif self.wait_s is not None and now - self._last > self.wait_s:
            raise self._expired(f"{what}: no record arrived")


async def partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """Every partition of ``topic``, from fresh cluster metadata ([] when it is missing).

    ``partitions_for_topic`` alone answers ``None`` until the consumer has metadata for
    the topic, which a manually assigned consumer may not have yet.
    """
    cluster = await consumer._client.fetch_all_metadata()
    return [TopicPartition(topic, p) for p in sorted(cluster.partitions_for_topic(topic) or ())]


async def stop(consumer: AIOKafkaConsumer) -> None:
    """Stop a consumer; yield once first so its coordinator task has started.

    aiokafka raises ``CancelledError`` from ``stop()`` when it cancels a coordinator task
    that never ran (aio-libs/aiokafka#647), for example right after ``assign()``.
    """
    await asyncio.sleep(0)
    await consumer.stop()


async def assign(consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> None:
    """Assign ``tps`` and wait until their initial positions are resolved.

    ``assign()`` starts an offset reset (to the consumer's ``auto_offset_reset``) in the
    background; a ``seek`` issued before it completes can be overridden by it, so a
    read "from the beginning" silently starts at the end. Awaiting ``position()`` first
    makes the following seeks stick.
    """
    consumer.assign(tps)
    for tp in tps:
        await consumer.position(tp)


class OffsetReader:
    """End and start offsets asked of the broker in one round trip each (no group)."""

    def __init__(self, kafka: KafkaConnection) -> None:
        self._kafka = kafka
        self._consumer: AIOKafkaConsumer | None = None

    async def _client(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = kafka_connect.consumer(self._kafka, enable_auto_commit=False)
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def ends(self, tps: Iterable[Any]) -> dict[Any, int]:
        """The end offset (the next record's) of each of ``tps`` (any (topic, partition)
        pairs; the answer is keyed by the pairs given)."""
        given = list(tps)
        if not given:
            return {}
        found = await (await self._client()).end_offsets([TopicPartition(*tp) for tp in given])
        return {tp: found[TopicPartition(*tp)] for tp in given}

    async def starts(self, tps: Iterable[Any]) -> dict[Any, int]:
        """The log start offset of each of ``tps`` (as :meth:`ends`)."""
        given = list(tps)
        if not given:
            return {}
        consumer = await self._client()
        found = await consumer.beginning_offsets([TopicPartition(*tp) for tp in given])
        return {tp: found[TopicPartition(*tp)] for tp in given}

    async def close(self) -> None:
        """Stop the client, if started."""
        if self._consumer is not None:
            await stop(self._consumer)
            self._consumer = None
