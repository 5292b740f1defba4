"""Failure modes with a real Redis server stopped for real, and a full publish buffer."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from spendgate.admission.fallback import DegradedLedger
from spendgate.admission.publisher import KafkaPublisher
from spendgate.schemas.kafka_connect import KafkaConnection
from tests.fixtures.admission import MakeAdmission, OwnRedis, RecordingPublisher
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class TestRedisDown:
    async def test_closed_refuses_with_a_clear_503_and_recovers(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(redis_url=own_redis.url)
        policy = policy_factory(limit=1000, unit="input_tokens", failure="closed")
        await adm.policies(policy)
        assert (await adm.admit("a", input_tokens=10)).status_code == 200
        before = _metric("spendgate_admission_store_failures_total", kind="connection")
        own_redis.stop()
        down = await adm.admit("a", input_tokens=10)
        assert down.status_code == 503
        error = down.json()["error"]
        assert error["code"] == "store_unavailable"
        assert policy.id in error["message"] and "fails closed" in error["message"]
        assert _metric("spendgate_admission_store_failures_total", kind="connection") > before
        assert (await adm.http.get("/readyz")).status_code == 503
        own_redis.start()
        await adm.policies(policy)
        back = await adm.admit("a", input_tokens=10)
        assert back.status_code == 200 and "Spendgate-Fallback" not in back.headers
        assert (await adm.http.get("/readyz")).status_code == 200

    async def test_open_admits_publishes_and_counts(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(redis_url=own_redis.url)
        await adm.policies(policy_factory(limit=10, unit="input_tokens", failure="open"))
        await adm.admit("a", input_tokens=1)
        own_redis.stop()
        before = _metric("spendgate_admission_fallback_total", mode="open", result="admitted")
        answers = [await adm.admit("a", input_tokens=8) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert answers[0].headers["Spendgate-Fallback"] == "open"
        after = _metric("spendgate_admission_fallback_total", mode="open", result="admitted")
        assert after - before == 3
        publisher = adm.publisher
        assert isinstance(publisher, RecordingPublisher)
        assert publisher.kinds() == ["reserve"] * 4
        # A reservation made without Redis is settled by this process.
        rid = answers[0].json()["reservation_id"]
        commit = await adm.http.post(
            "/v1/commit", json={"reservation_id": rid, "usage": {"input_tokens": 3}}
        )
        assert commit.status_code == 202
        assert publisher.kinds()[-1] == "commit"
        # Unknown reservations cannot be checked without Redis: 503, retriable.
        unknown = await adm.http.post("/v1/release", json={"reservation_id": "elsewhere"})
        assert unknown.status_code == 503

    async def test_degraded_spends_at_most_the_allowance_per_process(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        ledger = DegradedLedger()
        adm = await make_admission(redis_url=own_redis.url, ledger=ledger)
        policy = policy_factory(
            limit=1000, unit="input_tokens", failure="degraded", degraded_allowance=0.1
        )
        await adm.policies(policy)
        await adm.admit("a", input_tokens=1)
        own_redis.stop()
        answers = [await adm.admit("a", input_tokens=30) for _ in range(4)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        refused = answers[-1].json()
        assert refused["violated"] == [policy.id]
        assert 1 <= refused["retry_after_seconds"] <= 60
        assert answers[-1].headers["Spendgate-Fallback"] == "degraded"
        assert answers[2].json()["budgets"][0]["reserved"] == 90
        # Another key has its own allowance.
        assert (await adm.admit("b", input_tokens=100)).status_code == 200
        assert (await adm.admit("b", input_tokens=101)).json()["never_fits"] is True

    async def test_strictest_mode_wins_and_observe_never_refuses(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(redis_url=own_redis.url)
        open_p = policy_factory(id="open-p", failure="open", match={"env": "mixed"})
        closed_p = policy_factory(id="closed-p", failure="closed", match={"env": "mixed"})
        observed = policy_factory(
            id="watch", failure="closed", mode="observe", match={"env": "watch"}
        )
        await adm.policies(open_p, closed_p, observed)
        await adm.admit("a", input_tokens=1)
        own_redis.stop()
        mixed = await adm.admit("a", subject={"tenant": "a", "env": "mixed"}, input_tokens=1)
        assert mixed.status_code == 503
        watch = await adm.admit("a", subject={"tenant": "a", "env": "watch"}, input_tokens=1)
        assert watch.status_code == 200
        assert watch.headers["Spendgate-Fallback"] == "open"

    async def test_a_repeat_while_down_returns_the_same_reservation(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(redis_url=own_redis.url)
        await adm.policies(policy_factory(failure="open"))
        await adm.admit("a", input_tokens=1)
        own_redis.stop()
        first = await adm.admit("a", "same-id", input_tokens=5)
        again = await adm.admit("a", "same-id", input_tokens=5)
        assert first.json()["reservation_id"] == again.json()["reservation_id"]

    async def test_no_policies_ever_read_is_503(
        self, make_admission: MakeAdmission, own_redis: OwnRedis
    ) -> None:
        adm = await make_admission(redis_url=own_redis.url)
        own_redis.stop()
        answer = await adm.admit("a", input_tokens=1)
        assert answer.status_code == 503


class TestPublishBufferFull:
    async def test_full_buffer_follows_the_failure_mode(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        # A real producer that cannot reach any broker: events stay in the buffer.
        async with KafkaPublisher(
            KafkaConnection(bootstrap="127.0.0.1:1"), "nowhere.usage", buffer=1, shutdown_s=0.1
        ) as publisher:
            adm = await make_admission(publisher=publisher)
            closed_p = policy_factory(id="closed-p", failure="closed", match={"env": "c"})
            open_p = policy_factory(id="open-p", failure="open", match={"env": "o"})
            await adm.policies(closed_p, open_p)
            first = await adm.admit("a", subject={"tenant": "a", "env": "c"}, input_tokens=1)
            assert first.status_code == 200
            assert publisher.depth == 1
            refused = await adm.admit("a", subject={"tenant": "a", "env": "c"}, input_tokens=1)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "publish_unavailable"
            assert await adm.pending("closed-p|tenant=a") == 1  # nothing reserved for it
            before = _metric("spendgate_admission_publish_overflow_total", action="admitted")
            admitted = await adm.admit("a", subject={"tenant": "a", "env": "o"}, input_tokens=1)
            assert admitted.status_code == 200
            after = _metric("spendgate_admission_publish_overflow_total", action="admitted")
            assert after - before == 1
            metrics = (await adm.http.get("/metrics")).text
            assert "spendgate_admission_publish_buffer_events 1.0" in metrics
