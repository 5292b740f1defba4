"""End to end on a real broker and Redis: events raise windows; admission refuses and reserves."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from typing import Any

import httpx
import pytest
import redis

from spendgate.streams.settings import WorkerSettings
from tests.fixtures.factories import CommitFactory, PolicyFactory
from tests.fixtures.kafka_io import eventually, pending_sum, produce, window_sum
from tests.fixtures.pipeline import ApplyPolicies

pytestmark = pytest.mark.integration


def _admit_body(tenant: str, tokens: int) -> dict[str, Any]:
    return {
        "request_id": uuid.uuid4().hex,
        "subject": {"tenant": tenant, "model": "m1"},
        "estimate": {"input_tokens": tokens},
    }


class TestPipeline:
    async def test_commits_raise_the_window_and_an_over_limit_admit_is_refused(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        commit_factory: CommitFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(limit=1000, unit="total_tokens", window="1m", bucket="5s")
        await apply_policies(policy)
        key = f"{policy.id}|tenant=acme"
        events = [commit_factory(input_tokens=100, output_tokens=50) for _ in range(4)]
        # A duplicate delivery of the first event must not count again.
        await produce(
            worker_settings.kafka_bootstrap,
            worker_settings.topic("usage"),
            [(b"acme", e.model_dump_json().encode()) for e in [*events, events[0]]],
        )
        prefix = worker_settings.redis_prefix
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 600)

        refused = await admission_client.post("/v1/admit", json=_admit_body("acme", 401))
        assert refused.status_code == 429, refused.text
        body = refused.json()
        assert body["decision"] == "reject"
        assert body["violated"] == [policy.id]
        assert body["budgets"][0]["used"] == 600
        # `include` keeps the oldest bucket until it has wholly aged out: at most window + bucket.
        assert 1 <= int(refused.headers["Retry-After"]) <= 60 + 5

        allowed = await admission_client.post("/v1/admit", json=_admit_body("acme", 400))
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["budgets"][0]["remaining"] == 0

        # The worker absorbs the reservation from its reserve event: pending moves into the
        # window without a gap or a double count.
        await eventually(lambda: pending_sum(redis_sync, prefix, key) == 0)
        assert window_sum(redis_sync, prefix, key) == 1000

        never = await admission_client.post("/v1/admit", json=_admit_body("acme", 5000))
        assert never.status_code == 429
        assert never.json()["never_fits"] is True
        assert "Retry-After" not in never.headers

    async def test_concurrent_admits_never_reserve_more_than_the_limit(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(limit=1000, unit="input_tokens", window="1m", bucket="5s")
        await apply_policies(policy)
        key = f"{policy.id}|tenant=race"
        estimate = 30
        answers = await asyncio.gather(
            *(
                admission_client.post("/v1/admit", json=_admit_body("race", estimate))
                for _ in range(100)
            )
        )
        statuses = [a.status_code for a in answers]
        assert set(statuses) <= {200, 429}
        admitted = statuses.count(200)
        assert admitted == policy.limit // estimate
        held = pending_sum(redis_sync, worker_settings.redis_prefix, key) + window_sum(
            redis_sync, worker_settings.redis_prefix, key
        )
        assert held == admitted * estimate <= policy.limit

    async def test_repeated_request_id_returns_the_first_answer(
        self,
        worker: subprocess.Popen[bytes],
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(limit=100, unit="input_tokens")
        await apply_policies(policy)
        body = _admit_body("idem", 60)
        first = await admission_client.post("/v1/admit", json=body)
        again = await admission_client.post("/v1/admit", json=body)
        assert first.status_code == again.status_code == 200
        assert first.json()["reservation_id"] == again.json()["reservation_id"]
        other = await admission_client.post("/v1/admit", json=_admit_body("idem", 60))
        assert other.status_code == 429

    async def test_commit_replaces_and_release_frees_the_reservation(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(limit=1000, unit="input_tokens")
        await apply_policies(policy)
        key, prefix = f"{policy.id}|tenant=settle", worker_settings.redis_prefix
        kept = (await admission_client.post("/v1/admit", json=_admit_body("settle", 300))).json()
        freed = (await admission_client.post("/v1/admit", json=_admit_body("settle", 200))).json()
        committed = await admission_client.post(
            "/v1/commit",
            json={"reservation_id": kept["reservation_id"], "usage": {"input_tokens": 120}},
        )
        released = await admission_client.post(
            "/v1/release", json={"reservation_id": freed["reservation_id"]}
        )
        assert committed.status_code == released.status_code == 202
        await eventually(
            lambda: (
                pending_sum(redis_sync, prefix, key) == 0
                and window_sum(redis_sync, prefix, key) == 120
            )
        )
        unknown = await admission_client.post("/v1/release", json={"reservation_id": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["field"] == "reservation_id"
