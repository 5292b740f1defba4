"""Create spendgate's topics with the partition counts and cleanup policies they need."""

from __future__ import annotations

import contextlib
import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from streams.settings import WorkerSettings

logger = logging.getLogger(__name__)


async def ensure_topics(settings: WorkerSettings) -> None:
    """Create ``usage``, ``policies`` (compacted), ``alerts`` and ``dlq`` when missing."""
    wanted = [
        NewTopic(settings.topic("usage"), settings.partitions, 1),
        # Created here, not by faust: faust's assignor ignores a topic missing at subscribe time.
        NewTopic(settings.keyed_topic, settings.partitions, 1),
        NewTopic(settings.topic("policies"), 1, 1, topic_configs={"cleanup.policy": "compact"}),
        NewTopic(settings.topic("alerts"), 1, 1),
        NewTopic(settings.topic("dlq"), 1, 1),
    ]
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            # Another process may win the race; the topic is there either way.
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(missing)
            logger.info("created topics %s", [t.name for t in missing])
    finally:
        await admin.close()
