"""Create spendgate's topics with the partitions, retention, timestamps and replication they
need, and refuse to start on existing ones replicated less than the settings ask."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError

from spendgate.schemas import kafka_connect
from spendgate.schemas.kafka_connect import KafkaConnection, TopicReplication, shortfalls
from spendgate.schemas.policies import MAX_WINDOW_MS
from spendgate.schemas.types import parse_duration_ms
from spendgate.streams.exceptions import RetentionTooShortError, UnderReplicatedError
from spendgate.streams.settings import WorkerSettings

logger = logging.getLogger(__name__)


def usage_retention_ms(settings: WorkerSettings) -> int:
    """The retention ``usage`` is created with: the longest window any policy may have,
    plus the dedupe horizon that window implies, plus the margin."""
    return settings.retention_needed_ms(MAX_WINDOW_MS) + parse_duration_ms(
        settings.retention_margin
    )


def changelog_topic(settings: WorkerSettings) -> str:
    """The name faust gives the changelog of the worker's table (``keystate``)."""
    return f"{settings.app_id}-keystate-changelog"


async def ensure_topics(settings: WorkerSettings) -> None:
    """Create ``usage``, ``policies`` (compacted), ``alerts``, ``dlq``, ``refusals`` and the
    keyed topic when missing, and check the replication of those that exist.

    Every topic is created with ``SPENDGATE_KAFKA_REPLICATION_FACTOR`` replicas and
    ``min.insync.replicas`` = ``SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS``. An existing one (the
    table's changelog included) with fewer is refused (:func:`check_replication`).

    ``usage`` stamps records with the broker's clock (``LogAppendTime``: arrival time for
    the dedupe horizon) and keeps them as long as the longest allowed window needs;
    ``refusals`` (refused admissions, read by ``simulate`` beside ``usage``) is stamped and
    kept the same way. The worker never consumes ``refusals``.

    Raises:
        UnderReplicatedError: an existing topic has fewer replicas (or a lower
            ``min.insync.replicas``) than the settings ask, without the override.
    """
    kafka = settings.kafka()
    durable = kafka.topic_configs()
    rf = kafka.replication_factor
    usage_configs = {
        "message.timestamp.type": "LogAppendTime",
        "retention.ms": str(usage_retention_ms(settings)),
        **durable,
    }
    wanted = [
        NewTopic(settings.topic("usage"), settings.partitions, rf, topic_configs=usage_configs),
        # Created here, not by faust: faust's assignor ignores a topic missing at subscribe time.
        # Stamped by the broker: a keyed partition's watermark is read from its records'
        # append times (streams.marks).
        NewTopic(
            settings.keyed_topic,
            settings.partitions,
            rf,
            topic_configs={"message.timestamp.type": "LogAppendTime", **durable},
        ),
        NewTopic(
            settings.topic("policies"),
            1,
            rf,
            topic_configs={"cleanup.policy": "compact", **durable},
        ),
        NewTopic(settings.topic("alerts"), 1, rf, topic_configs=durable),
        NewTopic(settings.topic("dlq"), 1, rf, topic_configs=durable),
        NewTopic(settings.topic("refusals"), settings.partitions, rf, topic_configs=usage_configs),
    ]
    admin = kafka_connect.admin(kafka)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            # Another process may win the race; the topic is there either way.
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(missing)
            logger.info("created topics %s", [t.name for t in missing])
        # faust creates the changelog itself, with the same settings; one made before them
        # may have less.
        present = [t.name for t in wanted if t.name in existing]
        present += [name for name in (changelog_topic(settings),) if name in existing]
        check_replication(await describe_replication(admin, present), kafka)
    finally:
        await admin.close()


async def describe_replication(
    admin: AIOKafkaAdminClient, topics: list[str]
) -> list[TopicReplication]:
    """Each topic's replication factor (its least replicated partition's) and
    ``min.insync.replicas``, as the broker describes them."""
    if not topics:
        return []
    replicas: dict[str, int] = {}
    for _ in range(50):
        # A topic created a moment ago may not be described by every broker yet.
        described = await admin.describe_topics([t for t in topics if t not in replicas])
        replicas |= {
            t["topic"]: min(len(p["replicas"]) for p in t["partitions"])
            for t in described
            if t["partitions"]
        }
        if len(replicas) == len(topics):
            break
        await asyncio.sleep(0.1)
    wanted: dict[str, None] = {"min.insync.replicas": None}
    resources = [ConfigResource(ConfigResourceType.TOPIC, name, wanted) for name in topics]
    min_isr: dict[str, int] = {}
    for response in await admin.describe_configs(resources):
        for resource in response.resources:
            entries = {e[0]: e[1] for e in resource[4]}
            min_isr[resource[3]] = int(entries.get("min.insync.replicas") or 1)
    return [TopicReplication(name, replicas.get(name, 0), min_isr.get(name, 1)) for name in topics]


def check_replication(found: list[TopicReplication], kafka: KafkaConnection) -> None:
    """Log one line per under-replicated topic: an ERROR and a refusal, or a WARNING with
    ``SPENDGATE_KAFKA_ALLOW_UNDER_REPLICATED``.

    Raises:
        UnderReplicatedError: some topic is under-replicated and the override is not set.
    """
    lines = shortfalls(found, kafka)
    for line in lines:
        if kafka.allow_under_replicated:
            logger.warning("%s; starting anyway (SPENDGATE_KAFKA_ALLOW_UNDER_REPLICATED)", line)
        else:
            logger.error("%s", line)
    if lines and not kafka.allow_under_replicated:
        raise UnderReplicatedError(
            "; ".join(lines) + ": an acknowledged record could be lost with one broker. "
            "Raise them (kafka-reassign-partitions for replicas, kafka-configs --alter "
            "--add-config min.insync.replicas=N), or set "
            "SPENDGATE_KAFKA_ALLOW_UNDER_REPLICATED=true to start anyway"
        )


@dataclass(frozen=True, slots=True)
class UsageTopicConfig:
    """What the broker says about ``usage``: retention (-1: forever) and timestamp type."""

    retention_ms: int
    timestamp_type: str


async def describe_usage(settings: WorkerSettings, topic: str | None = None) -> UsageTopicConfig:
    """Read ``usage``'s (or ``topic``'s) retention and timestamp type from the broker."""
    admin = kafka_connect.admin(settings.kafka())
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
