"""No reservation escapes: the admit script lists each reservation until its reserve is
acked, and the sweeper republishes (same event id, same bytes) what stays unacked."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from spendgate.admission.publisher import KafkaPublisher
from spendgate.admission.reserves import reserve_event_from_record
from spendgate.admission.sweeper import ReserveSweeper
from spendgate.schemas.events import (
    CommitEvent,
    ReserveEvent,
    Subject,
    Usage,
    UsageEvent,
    parse_event,
)
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.prices import ModelPrice, PriceCatalog
from spendgate.schemas.redis_keys import reservation_key, unpublished_reserves_key
from tests.fixtures.admission import Admission, MakeAdmission, RecordingPublisher, free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import read_all
from tests.fixtures.services import Services

pytestmark = pytest.mark.integration


@dataclass
class SilentPublisher:
    """Accepts every event and never sends one: a process that dies before Kafka."""

    events: list[UsageEvent] = field(default_factory=list)

    def has_room(self) -> bool:
        return True

    def publish(self, event: UsageEvent) -> bool:
        self.events.append(event)
        return True

    async def publish_acked(self, event: UsageEvent) -> bool:
        self.events.append(event)
        return False


def _probe() -> CommitEvent:
    """An event that connects a publisher and creates the topic before a test measures."""
    rid = uuid.uuid4().hex
    return CommitEvent(
        event_id=f"probe-{rid}",
        subject=Subject(tenant="probe"),
        occurred_at=datetime.now(UTC),
        reservation_id=rid,
        usage=Usage(),
    )


def _reserves(events: list[UsageEvent]) -> list[ReserveEvent]:
    return [e for e in events if isinstance(e, ReserveEvent)]


async def _listed(adm: Admission) -> dict[str, int]:
    raw = await adm.redis.zrange(unpublished_reserves_key(adm.prefix), 0, -1, withscores=True)
    return {member.decode(): int(score) for member, score in raw}


async def _rebuilt(adm: Admission, rid: str) -> ReserveEvent | None:
    return reserve_event_from_record(rid, await adm.redis.hgetall(reservation_key(adm.prefix, rid)))


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def _admit_many(adm: Admission, n: int) -> list[str]:
    rids = []
    for i in range(n):
        answer = await adm.admit("acme", input_tokens=10 + i)
        assert answer.status_code == 200, answer.text
        rids.append(answer.json()["reservation_id"])
    return rids


class TestAdmitBookkeeping:
    async def test_a_reservation_is_listed_at_its_admission_and_its_record_rebuilds_the_event(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(
            policy_factory(id="tok", unit="input_tokens", limit=10_000, reservation_ttl="2m"),
            policy_factory(id="req", unit="requests", limit=100, reservation_ttl="7m"),
        )
        answer = await adm.admit(
            "acme",
            subject={"tenant": "acme", "model": "m1", "labels": {"team": "x"}},
            requests=1,
            input_tokens=800,
            cached_input_tokens=5,
        )
        assert answer.status_code == 200, answer.text
        (sent,) = _reserves(adm.publisher.events)  # type: ignore[attr-defined]
        rid = sent.reservation_id
        assert await _listed(adm) == {rid: sent.occurred_ms}
        rebuilt = await _rebuilt(adm, rid)
        assert rebuilt is not None
        assert rebuilt.model_dump_json() == sent.model_dump_json()  # same bytes, same id
        assert rebuilt.event_id == f"reserve-{rid}"
        assert rebuilt.expires_ms - rebuilt.occurred_ms == 7 * 60_000  # the longest TTL

    async def test_a_capped_and_a_downgraded_reservation_rebuild_what_was_published(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        prices = PriceCatalog(
            list_prices={
                "big": ModelPrice(input_per_mtok_micros=10_000_000, output_per_mtok_micros=0),
                "small": ModelPrice(input_per_mtok_micros=1_000_000, output_per_mtok_micros=0),
            }
        )
        adm = await make_admission(prices=prices)
        await adm.policies(
            policy_factory(id="cap", unit="output_tokens", limit=300, on_exceed="cap",
                           match={"model": "m1"}),
            policy_factory(id="big-cost", unit="cost_usd", limit=1500, match={"model": "big"},
                           on_exceed="downgrade", downgrade_to="small"),
        )  # fmt: skip
        capped = await adm.admit("c", output_tokens=500)
        assert capped.json()["decision"] == "cap", capped.text
        big = {"tenant": "d", "model": "big"}
        assert (await adm.admit("d", subject=dict(big), input_tokens=100)).status_code == 200
        down = await adm.admit("d", subject=dict(big), input_tokens=100)
        assert down.json()["decision"] == "downgrade", down.text
        sent = _reserves(adm.publisher.events)  # type: ignore[attr-defined]
        assert [e.usage.output_tokens for e in sent][:1] == [300]
        assert sent[-1].subject.model == "small"
        for event in sent:
            rebuilt = await _rebuilt(adm, event.reservation_id)
            assert rebuilt is not None
            assert rebuilt.model_dump_json() == event.model_dump_json()
        assert set(await _listed(adm)) == {e.reservation_id for e in sent}

    async def test_rejects_repeats_and_budget_reads_list_nothing(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(unit="input_tokens", limit=100))
        assert (await adm.admit("acme", "r1", input_tokens=60)).status_code == 200
        assert (await adm.admit("acme", "r1", input_tokens=60)).status_code == 200  # repeat
        assert (await adm.admit("acme", "r2", input_tokens=60)).status_code == 429
        read = await adm.http.get("/v1/budgets", params={"tenant": "acme", "model": "m1"})
        assert read.status_code == 200
        assert len(await _listed(adm)) == 1


class TestSweeper:
    async def test_two_racing_sweepers_republish_every_reservation_and_the_topic_holds_it(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        services: Services,
        topic_prefix: str,
        redis_client: aioredis.Redis,
    ) -> None:
        adm = await make_admission(publisher=SilentPublisher())
        await adm.policies(policy_factory(unit="input_tokens", limit=10**9))
        rids = await _admit_many(adm, 60)
        sent = {e.event_id: e for e in _reserves(adm.publisher.events)}  # type: ignore[attr-defined]
        topic = f"{topic_prefix}usage"
        before = _metric("spendgate_admission_reserves_republished_total")
        async with (
            KafkaPublisher(
                KafkaConnection(bootstrap=services.kafka_bootstrap), topic, 10_000
            ) as pub_a,
            KafkaPublisher(
                KafkaConnection(bootstrap=services.kafka_bootstrap), topic, 10_000
            ) as pub_b,
        ):
            assert await pub_a.publish_acked(_probe()) and await pub_b.publish_acked(_probe())
            a = ReserveSweeper(redis_client, adm.prefix, pub_a, grace_s=1.0, batch=7)
            b = ReserveSweeper(redis_client, adm.prefix, pub_b, grace_s=1.0, batch=7)
            pub_a.on_acked, pub_b.on_acked = a.acked, b.acked
            await asyncio.sleep(1.1)  # every listed reserve is past the grace period
            counts = await asyncio.gather(a.sweep(), b.sweep())
            await a.flush_acked()
            await b.flush_acked()
        # Both took part, and a claim held: each reservation was republished exactly once.
        assert all(counts) and sum(counts) == len(rids), counts
        assert _metric("spendgate_admission_reserves_republished_total") - before == sum(counts)
        assert await _listed(adm) == {}
        on_topic: Counter[str] = Counter()
        for raw in await read_all(services.kafka_bootstrap, topic):
            event = parse_event(raw)
            if event.event_id.startswith("probe-"):
                continue
            on_topic[event.event_id] += 1
            assert raw == sent[event.event_id].model_dump_json().encode()  # the same bytes
        assert on_topic == Counter(f"reserve-{r}" for r in rids)

    async def test_with_no_grace_racing_sweepers_still_end(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        redis_client: aioredis.Redis,
    ) -> None:
        adm = await make_admission(publisher=SilentPublisher())
        await adm.policies(policy_factory(unit="input_tokens", limit=10**9))
        rids = await _admit_many(adm, 20)
        acking = [RecordingPublisher(), RecordingPublisher()]
        sweepers = [ReserveSweeper(redis_client, adm.prefix, p, grace_s=0, batch=3) for p in acking]
        # A sweep never re-takes what it claimed itself (its cutoff is fixed at its start),
        # so it ends even though nothing is unlisted while it runs.
        counts = await asyncio.wait_for(asyncio.gather(*(s.sweep() for s in sweepers)), 30)
        assert sum(counts) >= len(rids)
        republished = {e.reservation_id for p in acking for e in _reserves(p.events)}
        assert republished == set(rids)

    async def test_an_acked_reserve_is_unlisted_and_never_republished(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        services: Services,
        topic_prefix: str,
        redis_client: aioredis.Redis,
    ) -> None:
        topic = f"{topic_prefix}usage"
        async with KafkaPublisher(
            KafkaConnection(bootstrap=services.kafka_bootstrap), topic, 10_000
        ) as pub:
            adm = await make_admission(publisher=pub)
            sweeper = ReserveSweeper(redis_client, adm.prefix, pub, grace_s=0, interval_s=3600)
            pub.on_acked = sweeper.acked
            async with sweeper:  # its own task unlists the acked reserves
                await adm.policies(policy_factory(unit="input_tokens", limit=10**9))
                rids = await _admit_many(adm, 40)
                assert await pub.flush(30)
                for _ in range(100):
                    if not await _listed(adm):
                        break
                    await asyncio.sleep(0.05)
                assert await _listed(adm) == {}
                assert await sweeper.sweep() == 0
        on_topic = Counter(parse_event(v).event_id for v in await read_all(services.kafka_bootstrap,
                                                                           topic))  # fmt: skip
        assert on_topic == Counter(f"reserve-{r}" for r in rids)

    async def test_a_claim_holds_for_a_grace_period_and_unacked_reserves_stay_listed(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        redis_client: aioredis.Redis,
    ) -> None:
        adm = await make_admission(publisher=RecordingPublisher())
        await adm.policies(policy_factory(unit="input_tokens", limit=10**9))
        rids = await _admit_many(adm, 3)
        admitted = await _listed(adm)
        await asyncio.sleep(0.3)
        never_acks = SilentPublisher()
        first = ReserveSweeper(redis_client, adm.prefix, never_acks, grace_s=0.2)
        assert await first.sweep() == 0  # published, no ack
        assert sorted(e.reservation_id for e in _reserves(never_acks.events)) == sorted(rids)
        claimed = await _listed(adm)
        assert set(claimed) == set(rids)  # still listed, re-scored at the claim
        assert all(claimed[r] > admitted[r] for r in rids)
        other = SilentPublisher()
        assert await ReserveSweeper(redis_client, adm.prefix, other, grace_s=0.2).sweep() == 0
        assert other.events == []  # claimed less than a grace period ago
        await asyncio.sleep(0.3)
        await ReserveSweeper(redis_client, adm.prefix, other, grace_s=0.2).sweep()
        assert sorted(e.reservation_id for e in _reserves(other.events)) == sorted(rids)

    async def test_a_listed_reserve_without_its_record_is_unlisted_and_counted(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        redis_client: aioredis.Redis,
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(unit="input_tokens", limit=10**9))
        gone, kept = await _admit_many(adm, 2)
        await adm.redis.delete(reservation_key(adm.prefix, gone))  # as if it expired
        before = _metric("spendgate_admission_reserves_unrecoverable_total")
        publisher = RecordingPublisher()
        assert await ReserveSweeper(redis_client, adm.prefix, publisher, grace_s=0).sweep() == 1
        assert [e.reservation_id for e in _reserves(publisher.events)] == [kept]
        assert _metric("spendgate_admission_reserves_unrecoverable_total") - before == 1
        assert set(await _listed(adm)) == {kept}  # unlisted only once acked


class TestPublisherHeldCopy:
    async def test_a_republish_of_a_queued_reserve_waits_for_that_copy(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(unit="input_tokens", limit=10**9))
        (rid,) = await _admit_many(adm, 1)
        event = await _rebuilt(adm, rid)
        assert event is not None
        dead = f"127.0.0.1:{free_port()}"
        topic = f"t{uuid.uuid4().hex[:8]}.usage"
        async with KafkaPublisher(KafkaConnection(bootstrap=dead), topic, 10, retry_s=0.1,
                                  ack_timeout_s=0.2, shutdown_s=0.2) as pub:  # fmt: skip
            assert pub.publish(event)
            assert not await pub.publish_acked(event)
            assert not await pub.publish_acked(event)
            assert pub.depth == 1  # never a second copy in the buffer
