"""Token buckets (policy ``burst``) in the admit script, on a real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from spendgate.schemas.redis_keys import burst_key
from tests.fixtures.admission import MakeAdmission
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration


class TestBurst:
    async def test_a_burst_of_100_against_capacity_10_admits_exactly_10_then_refills_at_rate(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(
            id="bursty",
            unit="requests",
            limit=1000,
            burst={"rate": 1, "per": "1s", "capacity": 10},
        )
        await adm.policies(policy)
        answers = await asyncio.gather(*(adm.admit("b", requests=1) for _ in range(100)))
        statuses = [a.status_code for a in answers]
        assert statuses.count(200) == 10
        assert statuses.count(429) == 90
        refused = next(a for a in answers if a.status_code == 429)
        body = refused.json()
        assert body["violated"] == ["bursty"]
        # One token comes back one second after the bucket emptied.
        assert body["retry_after_seconds"] == 1
        assert refused.headers["Retry-After"] == "1"
        assert refused.headers["RateLimit-Policy"] == '"bursty.burst";q=10;w=10'
        assert refused.headers["RateLimit"].startswith('"bursty.burst";r=0;t=')
        (item,) = body["budgets"]
        assert item["burst"]["capacity"] == 10 and item["burst"]["remaining"] == 0
        assert 9 <= item["burst"]["reset_after_seconds"] <= 10
        # The window held the 10 admitted, nothing for the refused.
        assert await adm.pending("bursty|tenant=b") == 10
        # Refill at rate: one token per second, so 1.5 s later exactly one more fits.
        await asyncio.sleep(1.5)
        again = await asyncio.gather(*(adm.admit("b", requests=1) for _ in range(20)))
        assert [a.status_code for a in again].count(200) == 1
        await asyncio.sleep(2.0)
        more = await asyncio.gather(*(adm.admit("b", requests=1) for _ in range(20)))
        assert [a.status_code for a in more].count(200) == 2
        assert await adm.pending("bursty|tenant=b") == 13

    async def test_a_burst_refusal_reserves_on_no_budget(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        org = policy_factory(id="org", unit="input_tokens", limit=10_000)
        per_key = policy_factory(
            id="per-key",
            unit="input_tokens",
            limit=10_000,
            group_by=["tenant", "api_key"],
            burst={"rate": 100, "per": "1m", "capacity": 300},
        )
        await adm.policies(org, per_key)
        subject = {"tenant": "t", "api_key": "k", "model": "m1"}
        assert (await adm.admit("t", subject=dict(subject), input_tokens=250)).status_code == 200
        refused = await adm.admit("t", subject=dict(subject), input_tokens=100)
        assert refused.status_code == 429
        assert refused.json()["violated"] == ["per-key"]
        # 50 tokens left; 50 more come back in 30 s at 100 per minute.
        assert refused.json()["retry_after_seconds"] == 30
        assert await adm.pending("org|tenant=t") == 250
        never = await adm.admit("t", subject=dict(subject), input_tokens=301)
        assert never.json()["never_fits"] is True

    async def test_a_lost_bucket_is_rebuilt_full_and_expires_when_full(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(
            id="lost", unit="requests", limit=1000, burst={"rate": 2, "per": "1s", "capacity": 4}
        )
        await adm.policies(policy)
        for _ in range(4):
            assert (await adm.admit("l", requests=1)).status_code == 200
        key = burst_key(adm.prefix, "lost|tenant=l")
        # Empty now: the state lives exactly until the bucket is full again (4 / 2 per s).
        assert 1500 <= await adm.redis.pttl(key) <= 2000
        assert (await adm.admit("l", requests=1)).status_code == 429
        # Reading the budgets shows the bucket and takes nothing from it.
        for _ in range(2):
            seen = await adm.http.get("/v1/budgets", params={"tenant": "l", "model": "m1"})
            (item,) = seen.json()["budgets"]
            assert item["burst"]["capacity"] == 4 and item["burst"]["remaining"] == 0
            assert 1 <= item["burst"]["reset_after_seconds"] <= 2
        await adm.redis.delete(key)  # as after a Redis loss
        assert (await adm.admit("l", requests=1)).status_code == 200

    async def test_cap_honours_the_bucket(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(
            id="capped",
            unit="output_tokens",
            limit=100_000,
            on_exceed="cap",
            burst={"rate": 1, "per": "1h", "capacity": 500},
        )
        await adm.policies(policy)
        assert (await adm.admit("c", output_tokens=400)).status_code == 200
        capped = await adm.admit("c", output_tokens=400)
        assert capped.json()["decision"] == "cap"
        assert capped.json()["max_output_tokens"] == 100
        started = time.monotonic()
        assert (await adm.admit("c", output_tokens=1)).status_code == 429
        assert time.monotonic() - started < 5
