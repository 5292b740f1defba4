"""Admission's background tasks live through store faults (issue 40): a Redis error in
unlisting acked reserves or in a sweep is a retry with backoff, never a dead task."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from redis.exceptions import SlotNotCoveredError

from spendgate.admission.sweeper import ReserveSweeper
from spendgate.schemas.events import ReserveEvent, Subject, Usage
from spendgate.schemas.redis_keys import unpublished_reserves_key
from tests.admission.test_reserve_sweeper import SilentPublisher

pytestmark = pytest.mark.integration


class Failover:
    """A Redis client whose first ``fails`` calls find no master for their slot (a
    cluster failover under way), then the real client's answers."""

    def __init__(self, real: aioredis.Redis, fails: int) -> None:
        self.real = real
        self.fails = fails

    def _fault(self) -> None:
        if self.fails > 0:
            self.fails -= 1
            raise SlotNotCoveredError("Slot 1234 is not covered by the cluster")

    async def zrem(self, *args: Any) -> Any:
        self._fault()
        return await self.real.zrem(*args)

    async def execute_command(self, *args: Any) -> Any:
        self._fault()
        return await self.real.execute_command(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _errors(task: str) -> float:
    value = REGISTRY.get_sample_value("spendgate_admission_store_errors_total", {"task": task})
    return value or 0.0


def _reserve(rid: str) -> ReserveEvent:
    now = datetime.now(UTC)
    return ReserveEvent(
        event_id=f"reserve-{rid}",
        subject=Subject(tenant="acme"),
        occurred_at=now,
        reservation_id=rid,
        usage=Usage(input_tokens=1),
        expires_at=now + timedelta(minutes=15),
    )


class TestSweeperFaults:
    async def test_unlisting_and_sweeping_go_on_after_a_failover(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        client = Failover(redis_client, fails=3)
        listed = unpublished_reserves_key(key_prefix)
        rid = uuid.uuid4().hex
        await redis_client.zadd(listed, {rid: 0})
        before = _errors("unlist_acked") + _errors("sweep_reserves")
        sweeper = ReserveSweeper(
            client,  # type: ignore[arg-type]
            key_prefix,
            SilentPublisher(),
            grace_s=3600,
            interval_s=0.05,
        )
        async with sweeper:
            sweeper.acked(_reserve(rid))
            deadline = asyncio.get_running_loop().time() + 10
            while await redis_client.zscore(listed, rid) is not None:
                assert asyncio.get_running_loop().time() < deadline, "never unlisted"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # a few sweeps after the faults
            assert all(not t.done() for t in sweeper._tasks), "a background task died"
        assert client.fails == 0
        assert _errors("unlist_acked") + _errors("sweep_reserves") - before == 3
