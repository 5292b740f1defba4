"""A full budget stays full when its policy is re-applied with another bucket or window,
through the documented API only (real Kafka, Redis, worker and admission app): fill it,
re-apply the same policy id, and probe."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from datetime import UTC, datetime

import httpx
import pytest
import redis

from spendgate.schemas import window_codec
from spendgate.schemas.events import CommitEvent, Subject, Usage
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import policies_key, window_key
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, pending_sum, produce, window_sum
from tests.fixtures.pipeline import ApplyPolicies

pytestmark = pytest.mark.integration

LIMIT = 100
PROBES = 50


async def _admit(client: httpx.AsyncClient, tenant: str) -> httpx.Response:
    return await client.post(
        "/v1/admit",
        json={
            "request_id": uuid.uuid4().hex,
            "subject": {"tenant": tenant, "model": "m1"},
            "estimate": {"requests": 1},
        },
    )


def _in_force(client: redis.Redis, prefix: str, policy: Policy) -> bool:
    raw = client.hget(policies_key(prefix), policy.id)
    if not isinstance(raw, bytes):
        return False
    held = Policy.model_validate(json.loads(raw))
    return (held.window_ms, held.bucket_ms) == (policy.window_ms, policy.bucket_ms)


def _stored_width(client: redis.Redis, prefix: str, key: str) -> int | None:
    raw = client.get(window_key(prefix, key))
    return window_codec.decode(raw).bucket_ms if isinstance(raw, bytes) else None


class TestPolicyEdits:
    @pytest.mark.parametrize(
        ("before", "after"),
        [
            (("1h", "1h"), ("1h", "1m")),  # narrower buckets: the reported under-count
            (("1h", "1m"), ("1h", "1h")),  # wider buckets
            (("24h", "1h"), ("1h", "1h")),  # a shorter window
            (("1h", "1h"), ("24h", "1h")),  # a longer window
        ],
        ids=["1h-buckets-to-1m", "1m-buckets-to-1h", "24h-window-to-1h", "1h-window-to-24h"],
    )
    async def test_a_full_budget_refuses_every_probe_after_the_edit(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
        before: tuple[str, str],
        after: tuple[str, str],
    ) -> None:
        policy = policy_factory(
            unit="requests", limit=LIMIT, window=before[0], bucket=before[1], on_exceed="reject"
        )
        await apply_policies(policy)
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        key = f"{policy.id}|tenant={tenant}"
        prefix = worker_settings.redis_prefix
        answers = [await _admit(admission_client, tenant) for _ in range(LIMIT)]
        assert [a.status_code for a in answers] == [200] * LIMIT
        assert (await _admit(admission_client, tenant)).status_code == 429
        # The worker absorbs every reservation into its window (the "filled").
        await eventually(
            lambda: (
                pending_sum(redis_sync, prefix, key) == 0
                and window_sum(redis_sync, prefix, key) == LIMIT
            ),
            what="the reservations absorbed",
        )
        edited = policy.model_copy(update={"window": after[0], "bucket": after[1]})
        edited = Policy.model_validate(edited.model_dump())
        await apply_policies(edited)
        await eventually(lambda: _in_force(redis_sync, prefix, edited), what="the edit in force")
        allowed = []
        for _ in range(PROBES):
            answer = await _admit(admission_client, tenant)
            assert answer.status_code in (200, 429), answer.text
            if answer.status_code == 200:
                allowed.append(answer.json())
            await asyncio.sleep(0.05)
        assert allowed == []
        # Once the worker has rewritten the key in the new width (any record of the key
        # does it: here a commit of no usage), the budget is still full.
        nothing = CommitEvent(
            event_id=uuid.uuid4().hex,
            subject=Subject(tenant=tenant, model="m1"),
            occurred_at=datetime.now(UTC),
            usage=Usage(requests=0),
        )
        await produce(
            worker_settings.kafka_bootstrap,
            worker_settings.topic("usage"),
            [(tenant.encode(), nothing.model_dump_json().encode())],
        )
        await eventually(
            lambda: _stored_width(redis_sync, prefix, key) == edited.bucket_ms,
            what="the key rewritten in the new width",
        )
        refused = [(await _admit(admission_client, tenant)).status_code for _ in range(10)]
        assert refused == [429] * 10
