"""Create spendgate's topics with the partitions, retention and timestamps they need."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError

from spendgate.schemas.policies import MAX_WINDOW_MS
from spendgate.schemas.types import parse_duration_ms
from spendgate.streams.exceptions import RetentionTooShortError
from spendgate.streams.settings import WorkerSettings

logger = logging.getLogger(__name__)


def usage_retention_ms(settings: WorkerSettings) -> int:
    """The retention ``usage`` is created with: the longest window any policy may have,
    plus the dedupe horizon that window implies, plus the margin."""
    return settings.retention_needed_ms(MAX_WINDOW_MS) + parse_duration_ms(
        settings.retention_margin
    )


async def ensure_topics(settings: WorkerSettings) -> None:
    """Create ``usage``, ``policies`` (compacted), ``alerts``, ``dlq`` and ``refusals``
    when missing.

    ``usage`` stamps records with the broker's clock (``LogAppendTime``: arrival time for
    the dedupe horizon) and keeps them as long as the longest allowed window needs;
    ``refusals`` (refused admissions, read by ``simulate`` beside ``usage``) is stamped and
    kept the same way. The worker never consumes ``refusals``.
    """
    usage_configs = {
        "message.timestamp.type": "LogAppendTime",
        "retention.ms": str(usage_retention_ms(settings)),
    }
    wanted = [
        NewTopic(settings.topic("usage"), settings.partitions, 1, topic_configs=usage_configs),
        # Created here, not by faust: faust's assignor ignores a topic missing at subscribe time.
        # Stamped by the broker: a keyed partition's watermark is read from its records'
        # append times (streams.marks).
        NewTopic(
            settings.keyed_topic,
            settings.partitions,
            1,
            topic_configs={"message.timestamp.type": "LogAppendTime"},
        ),
        NewTopic(settings.topic("policies"), 1, 1, topic_configs={"cleanup.policy": "compact"}),
        NewTopic(settings.topic("alerts"), 1, 1),
        NewTopic(settings.topic("dlq"), 1, 1),
        NewTopic(settings.topic("refusals"), settings.partitions, 1, topic_configs=usage_configs),
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


@dataclass(frozen=True, slots=True)
class UsageTopicConfig:
    """What the broker says about ``usage``: retention (-1: forever) and timestamp type."""

    retention_ms: int
    timestamp_type: str


async def describe_usage(settings: WorkerSettings, topic: str | None = None) -> UsageTopicConfig:
    """Read ``usage``'s (or ``topic``'s) retention and timestamp type from the broker."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        wanted = {"retention.ms": None, "message.timestamp.type": None}
        name = topic or settings.topic("usage")
        resource = ConfigResource(ConfigResourceType.TOPIC, name, wanted)
        (response,) = await admin.describe_configs([resource])
        entries = {e[0]: e[1] for e in response.resources[0][4]}
    finally:
        await admin.close()
    return UsageTopicConfig(
        retention_ms=int(entries.get("retention.ms") or -1),
        timestamp_type=str(entries.get("message.timestamp.type") or "CreateTime"),
    )


def check_usage(config: UsageTopicConfig, settings: WorkerSettings, longest_window_ms: int) -> None:
    """Refuse a ``usage`` topic that forgets before the windows do; warn on CreateTime.

    Raises:
        RetentionTooShortError: retention is below longest window + dedupe horizon.
    """
    topic = settings.topic("usage")
    if config.timestamp_type != "LogAppendTime":
        logger.warning(
            "topic %s stamps records with %s: arrival times (the dedupe horizon) then come "
            "from producers' clocks; set message.timestamp.type=LogAppendTime",
            topic,
            config.timestamp_type,
        )
    needed = settings.retention_needed_ms(longest_window_ms)
    if 0 <= config.retention_ms < needed:
        raise RetentionTooShortError(
            f"topic {topic} keeps records {config.retention_ms} ms, but the longest window "
            f"({longest_window_ms} ms) plus the dedupe horizon "
            f"({settings.horizon_ms(longest_window_ms)} ms) needs {needed} ms: replay could "
            f"not rebuild the windows. Raise it, e.g. kafka-configs --alter --entity-type "
            f"topics --entity-name {topic} --add-config retention.ms={needed}"
        )
