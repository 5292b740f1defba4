"""What the worker keeps in Redis: absorbing reservations without a gap, memory per key."""

from __future__ import annotations

import asyncio
import subprocess
import uuid

import httpx
import pytest
import redis

from schemas import window_codec
from schemas.redis_keys import pending_window_key, window_key
from streams.settings import WorkerSettings
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.pipeline import ApplyPolicies

pytestmark = pytest.mark.integration


def _held(client: redis.Redis, prefix: str, key: str) -> tuple[int, int]:
    """Window sum and pending sum of ``key``, read in one transaction."""
    with client.pipeline(transaction=True) as pipe:
        pipe.get(window_key(prefix, key))
        pipe.hvals(pending_window_key(prefix, key))
        raw, pending = pipe.execute()
    used = sum(window_codec.decode(raw).buckets.values()) if raw else 0
    return used, sum(int(v) for v in pending)


class TestAbsorption:
    async def test_absorbing_reservations_leaves_no_gap_and_no_double_count(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=10**6)
        await apply_policies(policy)
        key, prefix = f"{policy.id}|tenant=gap", worker_settings.redis_prefix
        answers = await asyncio.gather(
            *(
                admission_client.post(
                    "/v1/admit",
                    json={
                        "request_id": uuid.uuid4().hex,
                        "subject": {"tenant": "gap", "model": "m"},
                        "estimate": {"input_tokens": 100},
                    },
                )
                for _ in range(50)
            )
        )
        assert [a.status_code for a in answers] == [200] * 50
        samples: list[tuple[int, int]] = []
        for _ in range(3000):
            samples.append(_held(redis_sync, prefix, key))
            if samples[-1][1] == 0:
                break
            await asyncio.sleep(0.01)
        assert samples[-1] == (5000, 0), "the worker did not absorb every reservation"
        assert samples[0][1] > 0, "absorbed before the first sample: nothing was observed"
        # At every instant the reservations are held exactly once: in pending or in the window.
        assert {used + pending for used, pending in samples} == {5000}


class TestMemory:
    @pytest.mark.parametrize(("buckets", "limit_bytes"), [(1440, 16 * 1024), (60, 2 * 1024)])
    def test_redis_bytes_per_key(
        self, redis_sync: redis.Redis, key_prefix: str, buckets: int, limit_bytes: int
    ) -> None:
        minute = 60_000
        start = 1_800_000_000_000 - 1_800_000_000_000 % minute
        step = 1440 // buckets  # spread sparse buckets over the day
        state = {start + i * step * minute: 1_000_000 + i for i in range(buckets)}
        key = window_key(key_prefix, "daily-tokens|tenant=acme-corporation|api_key=k-1234567")
        redis_sync.set(key, window_codec.encode(state, minute))
        used = redis_sync.memory_usage(key)
        assert used is not None and used <= limit_bytes, used
