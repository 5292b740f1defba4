"""Commit and release answer 202 only once Kafka acked their event, else 503 (retry safe)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY

from spendgate.admission.publisher import KafkaPublisher
from spendgate.schemas.events import (
    CommitEvent,
    ReleaseEvent,
    ReserveEvent,
    Subject,
    Usage,
    UsageEvent,
)
from spendgate.schemas.kafka_connect import KafkaConnection
from tests.fixtures.admission import MakeAdmission, free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import read_all
from tests.fixtures.services import Services

pytestmark = pytest.mark.integration

SUBJECT = Subject(tenant="acme", model="m1")


@dataclass
class GatedPublisher:
    """Records every event; ``publish_acked`` answers ``acking`` (False: no ack in time)."""

    acking: bool = False
    events: list[UsageEvent] = field(default_factory=list)

    def has_room(self) -> bool:
        return True

    def publish(self, event: UsageEvent) -> bool:
        self.events.append(event)
        return True

    async def publish_acked(self, event: UsageEvent) -> bool:
        self.events.append(event)
        return self.acking


def _commit(n: int, rid: str | None = None) -> CommitEvent:
    rid = rid or uuid.uuid4().hex
    return CommitEvent(
        event_id=f"commit-{rid}",
        subject=SUBJECT,
        occurred_at=datetime.now(UTC),
        reservation_id=rid,
        usage=Usage(input_tokens=n),
    )


def _reserve() -> ReserveEvent:
    rid = uuid.uuid4().hex
    now = datetime.now(UTC)
    return ReserveEvent(
        event_id=f"reserve-{rid}",
        subject=SUBJECT,
        occurred_at=now,
        reservation_id=rid,
        usage=Usage(input_tokens=1),
        expires_at=now + timedelta(minutes=15),
    )


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class TestSettleAnswers:
    async def test_no_ack_is_503_outcome_unknown_and_the_retry_is_the_same_event(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        publisher = GatedPublisher()
        adm = await make_admission(publisher=publisher)
        await adm.policies(policy_factory(limit=1000, unit="input_tokens"))
        rids = [(await adm.admit("s", input_tokens=10)).json()["reservation_id"] for _ in "ab"]
        commit = {"reservation_id": rids[0], "usage": {"input_tokens": 5}}
        release = {"reservation_id": rids[1]}
        for path, body in (("/v1/commit", commit), ("/v1/release", release)):
            answer = await adm.http.post(path, json=body)
            assert answer.status_code == 503
            assert answer.headers["Retry-After"] == "1"
            error = answer.json()["error"]
            assert error["code"] == "outcome_unknown"
            assert "retrying the same call is safe" in error["message"]
        publisher.acking = True
        assert (await adm.http.post("/v1/commit", json=commit)).status_code == 202
        assert (await adm.http.post("/v1/release", json=release)).status_code == 202
        settled = [e for e in publisher.events if e.kind != "reserve"]
        assert [e.event_id for e in settled] == [
            f"commit-{rids[0]}",
            f"release-{rids[1]}",
            f"commit-{rids[0]}",
            f"release-{rids[1]}",
        ]

    async def test_admit_never_waits_for_an_ack(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        publisher = GatedPublisher()  # never acks: admits must not care
        adm = await make_admission(publisher=publisher)
        await adm.policies(policy_factory(limit=1000, unit="input_tokens"))
        assert (await adm.admit("s", input_tokens=10)).status_code == 200
        assert [e.kind for e in publisher.events] == ["reserve"]


@pytest.fixture
def usage_topic() -> str:
    return f"t{uuid.uuid4().hex[:10]}.usage"


class TestKafkaPublisher:
    async def test_acks_come_from_shared_batches_without_flushing(
        self, services: Services, usage_topic: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async def no_flush(self: AIOKafkaProducer) -> None:
            raise AssertionError("a per-request flush")

        monkeypatch.setattr(AIOKafkaProducer, "flush", no_flush)
        events = [_commit(i) for i in range(200)]
        async with KafkaPublisher(
            KafkaConnection(bootstrap=services.kafka_bootstrap), usage_topic, 10_000
        ) as pub:
            assert await pub.publish_acked(_commit(0))  # connected and topic created
            oks = await asyncio.gather(*(pub.publish_acked(e) for e in events))
            assert all(oks) and pub.depth == 0
        on_topic = [CommitEvent.model_validate_json(v).event_id for v in
                    await read_all(services.kafka_bootstrap, usage_topic)]  # fmt: skip
        assert sorted(on_topic[1:]) == sorted(e.event_id for e in events)

    async def test_the_same_event_id_is_sent_once_however_often_it_is_asked(
        self, services: Services, usage_topic: str
    ) -> None:
        event = _commit(7)
        async with KafkaPublisher(
            KafkaConnection(bootstrap=services.kafka_bootstrap), usage_topic, 100
        ) as pub:
            first = await asyncio.gather(*(pub.publish_acked(event) for _ in range(5)))
            again = await pub.publish_acked(event)  # a retry after the ack: answered at once
        assert first == [True] * 5 and again
        on_topic = await read_all(services.kafka_bootstrap, usage_topic)
        assert [CommitEvent.model_validate_json(v).event_id for v in on_topic] == [event.event_id]

    async def test_unreachable_kafka_is_a_bounded_wait_then_a_shutdown_report(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        dead = f"127.0.0.1:{free_port()}"
        commit, release, reserve = _commit(3), _commit(4), _reserve()
        release = ReleaseEvent(
            event_id=f"release-{release.reservation_id}",
            subject=SUBJECT,
            occurred_at=release.occurred_at,
            reservation_id=release.reservation_id,
        )
        before = {k: _metric("spendgate_admission_unpublished_at_shutdown_total", kind=k)
                  for k in ("reserve", "commit", "release")}  # fmt: skip
        caplog.set_level(logging.INFO, logger="spendgate.admission.publisher")
        pub = KafkaPublisher(KafkaConnection(bootstrap=dead), "never.usage", 100, retry_s=0.1,
                             ack_timeout_s=0.3, shutdown_s=0.5)  # fmt: skip
        async with pub:
            assert pub.publish(reserve)
            started = time.monotonic()
            assert not await pub.publish_acked(commit)
            assert 0.3 <= time.monotonic() - started < 1.5
            assert not await pub.publish_acked(release)
            assert not await pub.publish_acked(commit)  # a retry does not queue it twice
            assert pub.depth == 3
            started = time.monotonic()
        assert time.monotonic() - started < 3
        after = {k: _metric("spendgate_admission_unpublished_at_shutdown_total", kind=k)
                 for k in before}  # fmt: skip
        assert {k: after[k] - before[k] for k in before} == {
            "reserve": 1,
            "commit": 1,
            "release": 1,
        }
        errors = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.ERROR and r.name == "spendgate.admission.publisher"
        ]
        assert "3 events were not acknowledged" in errors[0]
        assert "commit=1, release=1, reserve=1" in errors[0]
        listed = set(errors[1].removeprefix("unpublished event ids: ").split())
        assert listed == {commit.event_id, release.event_id, reserve.event_id}
