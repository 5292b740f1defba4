"""Replication as a setting, on the real (single) broker: the topics are created with it,
and an existing topic replicated less than asked is refused unless the override is set."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
from aiokafka.admin import NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from spendgate.schemas import kafka_connect
from spendgate.streams.exceptions import UnderReplicatedError
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import (
    changelog_topic,
    check_replication,
    describe_replication,
    ensure_topics,
)

pytestmark = pytest.mark.integration

#: Kafka's code for a config set on the topic itself (not inherited from the broker).
TOPIC_CONFIG = 1


def _names(s: WorkerSettings) -> list[str]:
    return [s.topic(n) for n in ("usage", "policies", "alerts", "dlq", "refusals")] + [
        s.keyed_topic
    ]


@pytest.fixture
async def created(worker_settings: WorkerSettings) -> AsyncIterator[WorkerSettings]:
    """This test's topics, created by ``ensure_topics`` (and the table's changelog, made as
    faust would before these settings existed: no topic-level ``min.insync.replicas``);
    deleted afterwards."""
    await ensure_topics(worker_settings)
    admin = kafka_connect.admin(worker_settings.kafka())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(changelog_topic(worker_settings), 2, 1)])
        await describe_replication(admin, [changelog_topic(worker_settings)])  # known to all
        yield worker_settings
    finally:
        await admin.delete_topics([*_names(worker_settings), changelog_topic(worker_settings)])
        await admin.close()


class TestReplication:
    async def test_created_topics_carry_the_settings(self, created: WorkerSettings) -> None:
        admin = kafka_connect.admin(created.kafka())
        await admin.start()
        try:
            found = await describe_replication(admin, _names(created))
            resources = [
                ConfigResource(ConfigResourceType.TOPIC, name, {"min.insync.replicas": None})
                for name in _names(created)
            ]
            described = await admin.describe_configs(resources)
        finally:
            await admin.close()
        assert {(t.topic, t.replication_factor, t.min_insync_replicas) for t in found} == {
            (name, 1, 1) for name in _names(created)
        }
        entries = {
            resource[3]: entry
            for response in described
            for resource in response.resources
            for entry in resource[4]
        }
        assert set(entries) == set(_names(created))
        for entry in entries.values():
            assert entry[0:2] == ("min.insync.replicas", "1")
            assert entry[3] == TOPIC_CONFIG  # set on the topic, not the broker's default

    async def test_an_under_replicated_topic_is_refused(
        self, created: WorkerSettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        wanted = created.model_copy(
            update={"kafka_replication_factor": 3, "kafka_min_insync_replicas": 2}
        )
        with pytest.raises(UnderReplicatedError) as info:
            await ensure_topics(wanted)
        message = str(info.value)
        assert "SPENDGATE_KAFKA_ALLOW_UNDER_REPLICATED=true" in message
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        # One ERROR line per topic, naming it with what it has and what is wanted.
        assert len(errors) == len(_names(created)) + 1
        for name in [*_names(created), changelog_topic(created)]:
            line = next(e for e in errors if e.startswith(f"topic {name} "))
            assert "replication factor 1 < 3" in line and "min.insync.replicas 1 < 2" in line
            assert name in message

    async def test_the_override_starts_with_a_warning(
        self, created: WorkerSettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        wanted = created.model_copy(
            update={
                "kafka_replication_factor": 3,
                "kafka_min_insync_replicas": 2,
                "kafka_allow_under_replicated": True,
            }
        )
        await ensure_topics(wanted)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            w.startswith(f"topic {created.topic('usage')} is under-replicated")
            and "starting anyway" in w
            for w in warnings
        )

    async def test_enough_replication_passes(self, created: WorkerSettings) -> None:
        admin = kafka_connect.admin(created.kafka())
        await admin.start()
        try:
            found = await describe_replication(admin, _names(created))
        finally:
            await admin.close()
        check_replication(found, created.kafka())  # as asked: nothing to say
