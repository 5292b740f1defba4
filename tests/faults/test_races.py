"""Scenario 6: 500 concurrent admits over 3 real admission processes sharing one Redis.

The admitted estimates never exceed what was left on any budget key: the Lua
check-and-reserve is atomic across processes. Every answer is 200 or 429: Redis is up
and answers within the processes' 10 s timeout, so a 503 (store failure) or a 500 is a
failure of the test, never an acceptable answer; and a 429 must be justified by what the
test itself saw admitted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
import redis

from spendgate.schemas import window_codec
from spendgate.schemas.redis_keys import window_key
from spendgate.schemas.windows import WindowSpec
from tests.faults.conftest import AdmissionProc, AdmissionProcs, FaultRecord, write_policies
from tests.fixtures import held
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.key_ids import key_id
from tests.fixtures.seeds import rng as seeded
from tests.fixtures.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
SCENARIO = 6
ADMITS = 500


def _pending(client: redis.Redis, prefix: str, key: str) -> int:
    return held.pending_sum(client, prefix, key)


async def _fire(procs: list[AdmissionProc], bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=ADMITS, max_keepalive_connections=ADMITS)
    clients = [httpx.AsyncClient(base_url=p.url, timeout=60, limits=limits) for p in procs]
    try:
        return await asyncio.gather(
            *(clients[i % len(clients)].post("/v1/admit", json=b) for i, b in enumerate(bodies))
        )
    finally:
        for c in clients:
            await c.aclose()


async def _wait_policies(proc: AdmissionProc, wanted: set[str], timeout_s: float = 30) -> None:
    """Until ``proc`` answers budgets of every policy in ``wanted`` for a probe subject."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
        while True:
            answer = await http.get(
                "/v1/budgets", params={"tenant": "probe", "api_key": "k", "model": "m2"}
            )
            if answer.status_code == 200:
                seen = {b["policy"] for b in answer.json()["budgets"]}
                if wanted <= seen:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"{proc.name} did not load {wanted}: {answer.text}")
            await asyncio.sleep(0.1)


@pytest.fixture
def three(
    services: Services, admission_procs: AdmissionProcs, key_prefix: str, topic_prefix: str
) -> list[AdmissionProc]:
    return [
        admission_procs.start(
            kafka_bootstrap=services.kafka_bootstrap,
            redis_url=services.redis_url,
            topic_prefix=topic_prefix,
            redis_prefix=key_prefix,
            name=f"a{i}",
        )
        for i in range(3)
    ]


class TestRaces:
    async def test_500_concurrent_admits_over_3_processes_never_exceed_the_limit(
        self,
        services: Services,
        three: list[AdmissionProc],
        policy_factory: PolicyFactory,
        key_prefix: str,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        tenant_p = policy_factory(
            id="race-tenant", unit="input_tokens", limit=10_000, window="1m", bucket="5s",
            group_by=["tenant"], failure="closed",
        )  # fmt: skip
        key_p = policy_factory(
            id="race-key", unit="input_tokens", limit=4_000, window="1m", bucket="5s",
            group_by=["tenant", "api_key"], failure="closed", match={"model": "m2"},
        )  # fmt: skip
        await write_policies(services.redis_url, key_prefix, tenant_p, key_p)
        for proc in three:  # every process has read both policies
            await _wait_policies(proc, {"race-tenant", "race-key"})
        spec = WindowSpec(tenant_p.window_ms, tenant_p.bucket_ms)
        now_ms = int(time.time() * 1000)
        figures: dict[str, Any] = {}
        over_total = 0

        # Round 1: one key, a fixed estimate, usage already in the window.
        used = 1_234
        t1 = f"fixed-{uuid.uuid4().hex[:6]}"
        k1 = f"race-tenant|tenant={t1}"
        redis_sync.set(
            window_key(key_prefix, k1),
            window_codec.encode({spec.bucket_of(now_ms): used}, spec.bucket_ms),
        )
        est = 37
        bodies = [
            {"request_id": uuid.uuid4().hex, "subject": {"tenant": t1, "model": "m"},
             "estimate": {"input_tokens": est}}
            for _ in range(ADMITS)
        ]  # fmt: skip
        answers = await _fire(three, bodies)
        codes = Counter(a.status_code for a in answers)
        remaining = tenant_p.limit - used
        admitted = codes[200] * est
        figures["round1_fixed_estimate"] = {
            "admits": ADMITS, "estimate": est, "remaining_before": remaining,
            "answers": dict(codes), "admitted_units": admitted,
            "over_limit_units": max(0, admitted - remaining),
            "pending_in_redis": _pending(redis_sync, key_prefix, k1),
            "exactly_floor_remaining_over_estimate": codes[200] == remaining // est,
        }  # fmt: skip
        fault_record.add(**figures)
        over_total += max(0, admitted - remaining)
        assert set(codes) <= {200, 429}, codes
        # One key, one estimate: a refusal means fewer than `est` units were left, so
        # exactly floor(remaining / est) admits fit and every one of them is admitted.
        assert codes[200] == remaining // est
        assert admitted <= remaining
        assert _pending(redis_sync, key_prefix, k1) == admitted

        # Round 2: random estimates on two keys per request (tenant and api_key budgets).
        rng = seeded("races.round2")
        t2 = f"mixed-{uuid.uuid4().hex[:6]}"
        bodies = []
        for _ in range(ADMITS):
            bodies.append(
                {"request_id": uuid.uuid4().hex,
                 "subject": {"tenant": t2, "api_key": f"k{rng.randrange(3)}", "model": "m2"},
                 "estimate": {"input_tokens": rng.randint(1, 60)}}
            )  # fmt: skip
        answers = await _fire(three, bodies)
        codes = Counter(a.status_code for a in answers)

        def key_budget(body: dict[str, Any]) -> str:  # admission names it by the key id
            return f"race-key|tenant={t2}|api_key={key_id(body['subject']['api_key'])}"

        per_key: Counter[str] = Counter()
        for body, answer in zip(bodies, answers, strict=True):
            if answer.status_code == 200:
                amount = body["estimate"]["input_tokens"]
                per_key[f"race-tenant|tenant={t2}"] += amount
                per_key[key_budget(body)] += amount
        limits = {"race-tenant": tenant_p.limit, "race-key": key_p.limit}
        over2 = {k: max(0, v - limits[k.split("|")[0]]) for k, v in per_key.items()}
        # Admitted totals only grow in this round (nothing is released), so a request
        # refused at any moment still does not fit the final totals on one of its keys.
        unjustified = []
        for body, answer in zip(bodies, answers, strict=True):
            if answer.status_code == 429:
                amount = body["estimate"]["input_tokens"]
                keys = [f"race-tenant|tenant={t2}", key_budget(body)]
                if all(per_key[k] + amount <= limits[k.split("|")[0]] for k in keys):
                    unjustified.append(body["request_id"])
        pend_ok = all(_pending(redis_sync, key_prefix, k) == v for k, v in per_key.items())
        figures["round2_random_estimates_two_keys"] = {
            "admits": ADMITS, "answers": dict(codes), "admitted_units_per_key": dict(per_key),
            "limits": limits, "over_limit_units": sum(over2.values()),
            "pending_equals_admitted": pend_ok, "refusals_that_would_have_fit": len(unjustified),
        }  # fmt: skip
        fault_record.add(**figures)
        over_total += sum(over2.values())
        assert set(codes) <= {200, 429}, codes
        # 500 draws of 1..60 on one tenant (limit 10,000): the demand exceeds the limit, so
        # the round must both admit and refuse; a round with no 200 proves nothing.
        assert codes[200] > 0 and codes[429] > 0, codes
        assert not any(over2.values())
        assert not unjustified
        assert pend_ok

        # Round 3: the same request_id sent 9 times at once (3 per process): one reservation.
        t3 = f"same-{uuid.uuid4().hex[:6]}"
        ids = [uuid.uuid4().hex for _ in range(50)]
        bodies = [
            {"request_id": rid, "subject": {"tenant": t3, "model": "m"},
             "estimate": {"input_tokens": 10}}
            for rid in ids for _ in range(9)
        ]  # fmt: skip
        answers = await _fire(three, bodies)
        by_id: dict[str, set[str]] = {}
        for body, answer in zip(bodies, answers, strict=True):
            if answer.status_code == 200:
                by_id.setdefault(body["request_id"], set()).add(answer.json()["reservation_id"])
        held = _pending(redis_sync, key_prefix, f"race-tenant|tenant={t3}")
        figures["round3_same_request_id_x9"] = {
            "admits": len(bodies), "request_ids": len(ids),
            "answers": dict(Counter(a.status_code for a in answers)),
            "ids_with_more_than_one_reservation": sum(len(v) > 1 for v in by_id.values()),
            "pending_units": held, "expected_pending_units": 10 * len(by_id),
        }  # fmt: skip
        fault_record.fault("3 `spendgate admission` processes on one Redis, requests round-robin")
        fault_record.fault(f"{ADMITS} concurrent admits on one key, fixed estimate")
        fault_record.fault(f"{ADMITS} concurrent admits over 2 budgets each, random estimates")
        fault_record.fault("50 request ids each sent 9 times concurrently")
        fault_record.add(
            events_checked=2 * ADMITS + len(bodies),
            over_limit_units=over_total,
            **figures,
        )
        # 50 ids x 10 units on a fresh tenant (limit 10,000): every one fits, so every one
        # of the 450 answers is 200, and the 9 copies of an id share one reservation.
        round3_codes = Counter(a.status_code for a in answers)
        assert round3_codes == Counter({200: len(bodies)}), round3_codes
        assert set(by_id) == set(ids)
        assert all(len(v) == 1 for v in by_id.values())
        assert held == 10 * len(ids)
        assert over_total == 0
