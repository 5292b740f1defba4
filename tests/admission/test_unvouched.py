"""Admission decides only on windows a worker vouches for (issue 16, defect 2).

The worker's applied marks (``schemas.shards``) are written here by hand, as a worker
would leave them: every partition vouched for (the fixture's default), a partition's mark
deleted (Redis lost its data and the worker has not restored and caught up), or a mark
older than the staleness bound (the worker is dead or behind). The script checks them in
the same atomic step as the decision, and the policy's failure mode answers.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from spendgate.schemas.redis_keys import marks_key
from spendgate.schemas.shards import keyed_mark, partition_for
from spendgate.streams.materialize import RedisMaterializer
from tests.fixtures.admission import TOPOLOGY, VOUCHED, Admission, MakeAdmission
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration


def _metric(state: str, mode: str) -> float:
    labels = {"state": state, "mode": mode}
    return REGISTRY.get_sample_value("spendgate_admission_unvouched_total", labels) or 0.0


async def _redis_now_ms(adm: Admission) -> int:
    seconds, micros = await adm.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _wipe(adm: Admission) -> None:
    """Delete every key of this test's prefix, as a FLUSHDB or an empty failover would."""
    keys = [k async for k in adm.redis.scan_iter(match=f"{adm.prefix}*")]
    if keys:
        await adm.redis.delete(*keys)


class TestWipedRedis:
    async def test_the_issue_reproduction_no_longer_admits_on_an_empty_window(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        # Budget 1000, 900 used and visible; the keys vanish; 200 must not be admitted.
        adm = await make_admission()
        policy = policy_factory(limit=1000, unit="input_tokens", failure="closed")
        await adm.policies(policy)
        key = f"{policy.id}|tenant=acme"
        now = await _redis_now_ms(adm)
        await adm.usage(key, {now - now % 5000: 900}, 5000)
        seen = await adm.http.get("/v1/budgets", params={"tenant": "acme"})
        assert seen.json()["budgets"][0]["used"] == 900
        before = _metric("missing", "refused")
        await _wipe(adm)
        answer = await adm.admit("acme", input_tokens=200)
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "state_unvouched" and error["state"] == "missing"
        assert key in error["message"] and "fails closed" in error["message"]
        assert answer.headers["Retry-After"] == "1"
        assert _metric("missing", "refused") - before == 1
        # Nothing was reserved on the wiped window.
        assert await adm.pending(key) == 0

    async def test_budgets_report_the_state_of_each_window(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(failure="closed"))
        fine = await adm.http.get("/v1/budgets", params={"tenant": "acme"})
        assert fine.json()["budgets"][0].get("state") is None
        await adm.marks(None)
        lost = await adm.http.get("/v1/budgets", params={"tenant": "acme"})
        assert lost.status_code == 200
        assert lost.json()["budgets"][0]["state"] == "missing"


class TestStaleWorker:
    async def test_a_mark_older_than_the_bound_is_stale(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(staleness_s=30.0)
        await adm.policies(policy_factory(failure="closed"))
        now = await _redis_now_ms(adm)
        await adm.marks(now - 29_000)
        assert (await adm.admit("acme", input_tokens=1)).status_code == 200
        await adm.marks(now - 31_000)
        stale = await adm.admit("acme", input_tokens=1)
        assert stale.status_code == 503
        assert stale.json()["error"]["state"] == "stale"

    async def test_open_admits_holds_the_reservation_and_says_why(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(limit=100, unit="input_tokens", failure="open")
        await adm.policies(policy)
        await adm.marks((await _redis_now_ms(adm)) - 3_600_000)
        before = _metric("stale", "open")
        # 150 > 100: the stale window cannot refuse under ``open``.
        answer = await adm.admit("acme", input_tokens=150)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["decision"] == "allow" and body["state"] == "stale"
        assert body["budgets"][0]["state"] == "stale"
        assert "Spendgate-Fallback" not in answer.headers
        assert _metric("stale", "open") - before == 1
        # The reservation is held in Redis like any other, so the worker absorbs it.
        assert await adm.pending(f"{policy.id}|tenant=acme") == 150

    async def test_degraded_spends_the_process_allowance(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(
            policy_factory(
                limit=1000, unit="input_tokens", failure="degraded", degraded_allowance=0.1
            )
        )
        await adm.marks(None)
        answers = [await adm.admit("acme", input_tokens=40) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 429]
        assert {a.headers["Spendgate-Fallback"] for a in answers} == {"degraded"}

    async def test_observe_policies_never_refuse(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(failure="closed", mode="observe"))
        await adm.marks(None)
        answer = await adm.admit("acme", input_tokens=1)
        assert answer.status_code == 200
        assert answer.json()["budgets"][0]["state"] == "missing"


class TestPerKey:
    async def test_only_the_unvouched_key_falls_back_the_others_still_decide(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        tenant_p = policy_factory(id="per-tenant", limit=100, unit="input_tokens")
        global_p = policy_factory(
            id="all-tenants", limit=10**9, unit="input_tokens", group_by=[], failure="open"
        )
        await adm.policies(tenant_p, global_p)
        # Lose only the keyed partition of the global key (a tenant key depends on its
        # usage partition alone).
        lost = partition_for(b"all-tenants", TOPOLOGY.keyed)
        await adm.redis.hdel(marks_key(adm.prefix), keyed_mark(lost))
        fits = await adm.admit("acme", input_tokens=60)
        assert fits.status_code == 200
        states = {b["policy"]: b.get("state") for b in fits.json()["budgets"]}
        assert states == {"per-tenant": None, "all-tenants": "missing"}
        # The vouched tenant key still refuses what does not fit (60 + 60 > 100).
        over = await adm.admit("acme", input_tokens=60)
        assert over.status_code == 429
        assert over.json()["violated"] == ["per-tenant"]

    async def test_without_a_topology_every_window_is_missing(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        # Policies as a worker of an older release wrote them: no topology beside them.
        adm = await make_admission()
        await RedisMaterializer(adm.redis, adm.prefix).write_policies([policy_factory()])
        await adm.marks(VOUCHED)
        answer = await adm.admit("acme", input_tokens=1)
        assert answer.status_code == 503
        assert answer.json()["error"]["state"] == "missing"
