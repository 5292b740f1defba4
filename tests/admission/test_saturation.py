"""Saturation is not an outage: a private Redis made slow, a pool of one connection.

Every server here is this test's own ``redis-server`` (``own_redis``): ``DEBUG SLEEP``
never reaches the shared one.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import redis
from prometheus_client import REGISTRY

from tests.fixtures.admission import Admission, MakeAdmission, OwnRedis
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _failures() -> float:
    return sum(
        _metric("spendgate_admission_store_failures_total", kind=k)
        for k in ("timeout", "connection", "skipped")
    )


def _overloads() -> float:
    return sum(
        _metric("spendgate_admission_overloaded_total", reason=r)
        for r in ("queue_full", "queue_wait", "pool_wait", "loop_lag")
    )


@contextmanager
def slow_redis(server: OwnRedis, sleep_s: float) -> Iterator[None]:
    """Keep ``server`` busy: ``DEBUG SLEEP sleep_s`` again and again from another
    connection, so a call may wait for its turn up to twice ``sleep_s`` (it can lose the race
    to the next sleep once), kept well under the timeout; a short pause between sleeps lets
    the waiting calls through."""
    stop = threading.Event()

    def sleeper() -> None:
        client = redis.Redis(port=server.port, socket_timeout=5)
        try:
            while not stop.is_set():
                client.execute_command("DEBUG", "SLEEP", sleep_s)
                time.sleep(0.002)
        finally:
            client.close()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


async def _burst(adm: Admission, tenant: str, n: int, tokens: int) -> list[httpx.Response]:
    return list(
        await asyncio.gather(
            *(adm.admit(tenant, uuid.uuid4().hex, input_tokens=tokens) for _ in range(n))
        )
    )


def _kinds(answers: list[httpx.Response]) -> Counter[str]:
    """200, 429, or the 503's error code."""
    out: Counter[str] = Counter()
    for a in answers:
        if a.status_code == 503:
            out[f"503 {a.json()['error']['code']}"] += 1
            assert a.headers["Retry-After"] == "1"
        else:
            out[str(a.status_code)] += 1
    return out


class TestSaturation:
    async def test_a_full_queue_answers_overloaded_never_the_failure_mode(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(
            redis_url=own_redis.url, redis_connections=1, redis_queue=8, redis_queue_wait_s=0.2
        )
        await adm.policies(policy_factory(limit=1000, unit="input_tokens", failure="closed"))
        assert (await adm.admit("a", input_tokens=1)).status_code == 200
        failures, overloads = _failures(), _overloads()
        before = _metric("spendgate_admission_decisions_total", decision="overloaded")
        with slow_redis(own_redis, 0.05):
            answers = await _burst(adm, "a", 40, 40)
        kinds = _kinds(answers)
        assert set(kinds) <= {"200", "429", "503 overloaded"}, kinds
        assert kinds["200"] >= 1 and kinds["503 overloaded"] >= 10, kinds
        assert _failures() == failures
        # Policy re-reads refused as overload too count here (they keep the last policies).
        assert _overloads() - overloads >= kinds["503 overloaded"]
        after = _metric("spendgate_admission_decisions_total", decision="overloaded")
        assert after - before == kinds["503 overloaded"]

    async def test_a_deep_queue_waits_its_turn(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(
            redis_url=own_redis.url, redis_connections=1, redis_queue=64, redis_queue_wait_s=10
        )
        await adm.policies(policy_factory(limit=1000, unit="input_tokens", failure="open"))
        assert (await adm.admit("a", input_tokens=1)).status_code == 200
        failures, overloads = _failures(), _overloads()
        # 40 calls one after another on a Redis asleep most of the time: over a second of
        # waiting for the one connection, none of it Redis failing.
        with slow_redis(own_redis, 0.05):
            answers = await _burst(adm, "a", 40, 40)
        kinds = _kinds(answers)
        assert kinds == {"200": 24, "429": 16}, kinds
        assert all("Spendgate-Fallback" not in a.headers for a in answers)
        assert (_failures(), _overloads()) == (failures, overloads)

    async def test_a_redis_that_stops_answering_mid_call_follows_the_failure_mode(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(
            redis_url=own_redis.url, redis_connections=1, redis_timeout_s=0.4
        )
        await adm.policies(policy_factory(limit=1000, unit="input_tokens", failure="closed"))
        assert (await adm.admit("a", input_tokens=1)).status_code == 200
        before = _metric("spendgate_admission_store_failures_total", kind="timeout")
        # The script is sent and Redis holds it past the 0.4 s timeout.
        with slow_redis(own_redis, 1.0):
            await asyncio.sleep(0.1)
            answer = await adm.admit("a", input_tokens=1)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "store_unavailable"
        assert _metric("spendgate_admission_store_failures_total", kind="timeout") > before

    async def test_an_unreachable_redis_follows_the_failure_mode_under_a_burst(
        self, make_admission: MakeAdmission, own_redis: OwnRedis, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(redis_url=own_redis.url, redis_connections=1)
        await adm.policies(policy_factory(limit=1000, unit="input_tokens", failure="open"))
        assert (await adm.admit("a", input_tokens=1)).status_code == 200
        own_redis.stop()
        overloads = _overloads()
        answers = await _burst(adm, "a", 20, 10)
        assert [a.status_code for a in answers] == [200] * 20
        assert all(a.headers["Spendgate-Fallback"] == "open" for a in answers)
        assert _overloads() == overloads
