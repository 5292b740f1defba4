"""``spendgate budgets`` on a real worker's Redis: top budgets by utilization, filters."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import redis

from spendgate.budgets import top_budgets
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, produce, window_sum
from tests.fixtures.pipeline import ApplyPolicies
from tests.integration.test_worker import event

pytestmark = pytest.mark.integration


class TestBudgetsCommand:
    async def test_top_budgets_by_share_with_forecast_and_filters(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens", limit=1000, window="1h", bucket="1m", group_by=["tenant"]
        )
        await apply_policies(policy)
        spent = {"acme": 900, "beta": 300, "gamma": 50}
        await produce(
            worker_settings.kafka_bootstrap,
            worker_settings.topic("usage"),
            [(t.encode(), event(tenant=t, usage={"input_tokens": n})) for t, n in spent.items()],
        )
        prefix = worker_settings.redis_prefix
        for t, n in spent.items():
            key = f"{policy.id}|tenant={t}"
            await eventually(lambda k=key, n=n: window_sum(redis_sync, prefix, k) == n, what=t)

        rows = await top_budgets(worker_settings.redis_url, prefix, top=2)
        assert [(r.key, r.used, r.limit) for r in rows] == [
            (f"{policy.id}|tenant=acme", 900, 1000),
            (f"{policy.id}|tenant=beta", 300, 1000),
        ]
        # All spent in the last minute: at that rate acme's 100 left go in seconds.
        assert rows[0].exhausts_in_seconds is not None and rows[0].exhausts_in_seconds <= 60
        assert rows[0].retry_after_seconds == 0
        only = await top_budgets(
            worker_settings.redis_url, prefix, top=5, subject=[("tenant", "gamma")]
        )
        assert [r.key for r in only] == [f"{policy.id}|tenant=gamma"]
        assert await top_budgets(worker_settings.redis_url, prefix, top=5, tenant="nobody") == []

        env = {
            **os.environ,
            "SPENDGATE_REDIS_URL": worker_settings.redis_url,
            "SPENDGATE_REDIS_PREFIX": prefix,
            "COLUMNS": "200",
        }
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "spendgate", "budgets", "-n", "1"],
            env=env, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()
        out = done.stdout.decode()
        assert "tenant=acme" in out and "900 / 1,000" in out and "tenant=beta" not in out
