"""Enforcement actions end to end on real Kafka + Redis and a real worker: ``delay`` held until
usage the worker absorbed ages out, and ``route`` charged on the routed pool by the worker."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import redis

from spendgate.schemas.events import CommitEvent, Subject, Usage
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import buckets, eventually, pending_sum, produce
from tests.fixtures.pipeline import ApplyPolicies

pytestmark = pytest.mark.integration

WINDOW_MS = 30_000
BUCKET_MS = 1000


def _in_window(client: redis.Redis, prefix: str, key: str) -> int:
    """What the worker's window holds for ``key`` inside the trailing window now."""
    oldest = int(time.time() * 1000) - WINDOW_MS - BUCKET_MS
    return sum(v for start, v in buckets(client, prefix, key).items() if start > oldest)


class TestDelayEndToEnd:
    async def test_held_requests_are_admitted_as_the_bucket_ages_out_and_never_overshoot(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(
            unit="requests",
            limit=5,
            window="30s",
            bucket="1s",
            on_exceed="delay",
            max_delay="15s",
        )
        await apply_policies(policy)
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        # 5 requests charged 24 s ago, through Kafka and the worker: the window is full
        # until their bucket ages out, some 6 s from now (within max_delay).
        past = datetime.now(UTC) - timedelta(seconds=24)
        subject = Subject(tenant="acme", model="m1")
        commits = [
            CommitEvent(
                event_id=uuid.uuid4().hex,
                subject=subject,
                occurred_at=past,
                usage=Usage(requests=1),
            )
            for _ in range(5)
        ]
        await produce(
            worker_settings.kafka_bootstrap,
            worker_settings.topic("usage"),
            [(b"acme", c.model_dump_json().encode()) for c in commits],
        )
        await eventually(lambda: _in_window(redis_sync, prefix, key) == 5, what="commits absorbed")
        start = int(past.timestamp() * 1000) // BUCKET_MS * BUCKET_MS
        fits_at_ms = start + WINDOW_MS + BUCKET_MS - 1  # the "include" boundary bucket
        assert fits_at_ms - time.time() * 1000 > 1000, "the window aged out before the test"

        async def admit() -> tuple[httpx.Response, float]:
            answer = await admission_client.post(
                "/v1/admit",
                json={
                    "request_id": uuid.uuid4().hex,
                    "subject": {"tenant": "acme", "model": "m1"},
                    "estimate": {"requests": 1},
                },
            )
            return answer, time.time() * 1000

        results = await asyncio.gather(*(admit() for _ in range(200)))
        admitted = [(a, at) for a, at in results if a.status_code == 200]
        assert len(admitted) == 5
        assert sum(a.status_code == 429 for a, _ in results) == 195
        for answer, at in admitted:
            assert answer.json()["decision"] == "allow"
            assert abs(at - fits_at_ms) <= 1000, (at, fits_at_ms)
        # Never over the limit: the worker absorbs the 5 reserves into the window.
        await eventually(
            lambda: (
                pending_sum(redis_sync, prefix, key) == 0
                and _in_window(redis_sync, prefix, key) == 5
            ),
            what="reserves absorbed",
        )


class TestRouteEndToEnd:
    async def test_a_routed_reservation_is_charged_on_the_routed_pool(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens",
            limit=100,
            group_by=["pool"],
            on_exceed="route",
            route_to="west",
        )
        await apply_policies(policy)
        prefix = worker_settings.redis_prefix

        async def admit(tokens: int) -> httpx.Response:
            return await admission_client.post(
                "/v1/admit",
                json={
                    "request_id": uuid.uuid4().hex,
                    "subject": {"tenant": "acme", "model": "m1", "pool": "east"},
                    "estimate": {"input_tokens": tokens},
                },
            )

        assert (await admit(80)).json()["decision"] == "allow"
        routed = await admit(50)
        assert routed.json()["decision"] == "route" and routed.json()["route_to"] == "west"
        commit = await admission_client.post(
            "/v1/commit",
            json={"reservation_id": routed.json()["reservation_id"], "usage": {"input_tokens": 40}},
        )
        assert commit.status_code == 202
        east, west = f"{policy.id}|pool=east", f"{policy.id}|pool=west"
        await eventually(
            lambda: (
                pending_sum(redis_sync, prefix, west) == 0
                and _in_window(redis_sync, prefix, west) == 40
                and _in_window(redis_sync, prefix, east) == 80
            ),
            what="the routed commit charged on west",
        )
