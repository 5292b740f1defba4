"""The Worker's handling of faust's signals, on an app that is never started (no broker)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from prometheus_client import REGISTRY

from spendgate.schemas.windows import WindowSpec
from spendgate.streams.app import Worker, faust_app
from spendgate.streams.commit import Carried
from spendgate.streams.effects import KeyWrite
from spendgate.streams.health import WorkerHealth
from spendgate.streams.ledger import KeyState
from spendgate.streams.settings import WorkerSettings


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    settings = WorkerSettings(data_dir=tmp_path, app_id="unit-worker")
    worker = Worker(faust_app(settings), settings, {}, -1, WorkerHealth())
    yield worker
    worker.ids.close()


def carried(partition: int, key: str) -> Carried:
    spec = WindowSpec(60_000, 1_000)
    return Carried(partition, KeyWrite(key, KeyState(), spec, window_changed=True))


class TestRebalance:
    def test_the_carried_writes_of_partitions_gone_are_dropped(self, worker: Worker) -> None:
        worker.unmirrored["usage"] = {"a": carried(0, "a"), "b": carried(1, "b")}
        worker.unmirrored["keyed"] = {"c": carried(0, "c"), "d": carried(1, "d")}
        worker.on_assigned(
            {
                TopicPartition(worker.names["usage"], 1),
                TopicPartition(worker.names["keyed"], 0),
                TopicPartition("budget.policies", 0),
            }
        )
        assert set(worker.unmirrored["usage"]) == {"b"}
        assert set(worker.unmirrored["keyed"]) == {"c"}

    def test_the_carried_writes_are_a_gauge(self, worker: Worker) -> None:
        worker.unmirrored["usage"] = {"a": carried(0, "a"), "b": carried(1, "b")}
        worker.unmirrored["keyed"] = {"c": carried(0, "c")}
        assert REGISTRY.get_sample_value("spendgate_worker_carried_writes") == 3
        worker.on_assigned({TopicPartition(worker.names["usage"], 0)})
        assert REGISTRY.get_sample_value("spendgate_worker_carried_writes") == 1

    def test_nothing_owned_drops_every_carried_write(self, worker: Worker) -> None:
        worker.unmirrored["usage"] = {"a": carried(0, "a")}
        worker.on_assigned(set())
        assert worker.unmirrored["usage"] == {}


class TestReplication:
    def test_the_changelog_and_faust_topics_follow_the_settings(self, tmp_path: Path) -> None:
        settings = WorkerSettings(
            data_dir=tmp_path,
            app_id="unit-replicated",
            kafka_replication_factor=3,
            kafka_min_insync_replicas=2,
        )
        worker = Worker(faust_app(settings), settings, {}, -1, WorkerHealth())
        try:
            assert worker.app.conf.topic_replication_factor == 3
            changelog = worker.table.changelog_topic
            assert changelog.get_topic_name() == "unit-replicated-keystate-changelog"
            assert changelog.config == {"min.insync.replicas": "2"}
            assert changelog.replicas is None  # faust then uses topic_replication_factor
        finally:
            worker.ids.close()
