"""The worker's health endpoint: /metrics, /healthz and /readyz from a daemon thread."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter

from spendgate.streams.health import PartitionHealth, WorkerHealth
from spendgate.streams.health_server import HealthServer


@pytest.fixture
def served() -> Iterator[tuple[WorkerHealth, str]]:
    health = WorkerHealth()
    server = HealthServer(health, 0).start()
    yield health, f"http://127.0.0.1:{server.port}"
    server.stop()


def _vouched(field: str) -> PartitionHealth:
    return PartitionHealth(field, "vouched", watermark_ms=1_000, records_behind=0)


class TestReadiness:
    def test_not_ready_until_assigned_and_vouched(self, served: tuple[WorkerHealth, str]) -> None:
        health, url = served
        first = httpx.get(f"{url}/readyz")
        assert first.status_code == 503
        assert first.headers["content-type"] == "application/json"
        assert first.json() == {
            "ready": False,
            "assigned": False,
            "generation": None,
            "updated_s_ago": None,
            "partitions": [],
        }
        health.update([_vouched("usage:0"), _vouched("keyed:0")], assigned=True, generation=3)
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 200, ready.text
        body = ready.json()
        assert body["ready"] is True and body["assigned"] is True and body["generation"] == 3
        assert body["partitions"][0] == {
            "field": "usage:0",
            "state": "vouched",
            "watermark_ms": 1_000,
            "records_behind": 0,
        }
        assert 0 <= body["updated_s_ago"] < 5

    def test_a_held_partition_is_not_ready(self, served: tuple[WorkerHealth, str]) -> None:
        health, url = served
        held = PartitionHealth("usage:1", "held", watermark_ms=None, records_behind=40)
        health.update([_vouched("usage:0"), held], assigned=True)
        answer = httpx.get(f"{url}/readyz")
        assert answer.status_code == 503
        assert answer.json()["partitions"][1]["state"] == "held"

    def test_updates_that_stop_coming_make_it_unready(self) -> None:
        health = WorkerHealth(stale_after_s=0.0)
        server = HealthServer(health, 0).start()
        try:
            health.update([_vouched("usage:0")], assigned=True)
            # Zero seconds of grace: the update is already too old when read.
            assert httpx.get(f"http://127.0.0.1:{server.port}/readyz").status_code == 503
        finally:
            server.stop()

    def test_liveness_does_not_depend_on_readiness(self, served: tuple[WorkerHealth, str]) -> None:
        _, url = served
        answer = httpx.get(f"{url}/healthz")
        assert answer.status_code == 200 and answer.json() == {"status": "ok"}
        assert httpx.get(f"{url}/nothing").status_code == 404


class TestMetrics:
    def test_prometheus_text_of_the_default_registry(
        self, served: tuple[WorkerHealth, str]
    ) -> None:
        _, url = served
        answer = httpx.get(f"{url}/metrics")
        assert answer.status_code == 200
        assert answer.headers["content-type"] == CONTENT_TYPE_LATEST
        assert "# TYPE" in answer.text and "python_info" in answer.text

    def test_a_given_registry(self) -> None:
        registry = CollectorRegistry()
        Counter("sg_test_things", "things", registry=registry).inc(3)
        server = HealthServer(WorkerHealth(), 0, registry=registry).start()
        try:
            text = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
        finally:
            server.stop()
        assert "sg_test_things_total 3.0" in text

    def test_a_taken_port_is_refused_at_once(self, served: tuple[WorkerHealth, str]) -> None:
        _, url = served
        with pytest.raises(OSError):
            HealthServer(WorkerHealth(), int(url.rsplit(":", 1)[1]))
