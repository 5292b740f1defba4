"""Small aiokafka helpers shared by the replay, the alert feed and the tests."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, TopicPartition


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
