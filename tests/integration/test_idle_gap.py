"""A partition idle longer than the staleness bound, then one record: no spurious 503.

The reproduction of issue 23, scaled down: with a 5 s bound, one usage partition gets
nothing for 6 s, then one commit. Before the watermarks were defined, that partition's mark
jumped back to the record before the gap while the worker applied the commit, and every key
depending on it (a budget spanning tenants depends on every usage partition) answered ``503
state_unvouched`` for about 1.5 s, though the worker was alive and caught up. Here every
admit, throughout, must be decided.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import httpx
import pytest

from spendgate.schemas.shards import partition_for
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.factories import CommitFactory, PolicyFactory
from tests.fixtures.kafka_io import produce
from tests.fixtures.pipeline import ApplyPolicies, Workers

pytestmark = pytest.mark.integration

STALENESS_S = 5.0
IDLE_S = 6.0
#: How long a batch's first record waits for more: the time a record sits between its
#: append and its application, when a mark used to be written from the record before the
#: gap (the wider it is, the surer the old defect shows). A record of a key spanning
#: tenants lingers twice (usage, then keyed), so its true watermark is about 2-3 s old
#: here: the bound is 5 s, not 3.
LINGER_S = 1.0
CYCLES = 5


@pytest.fixture
def admission_staleness_s() -> float:
    return STALENESS_S


def _tenants_on_each_partition(partitions: int) -> list[str]:
    """One tenant per usage partition (records are keyed by tenant)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        found.setdefault(partition_for(f"t{i}".encode(), partitions), f"t{i}")
        i += 1
    return [found[p] for p in range(partitions)]


class TestIdleGap:
    async def test_one_record_after_an_idle_gap_leaves_every_admit_decided(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        commit_factory: CommitFactory,
        admission_client: httpx.AsyncClient,
    ) -> None:
        workers.start(env={"SPENDGATE_BATCH_LINGER_S": str(LINGER_S)})
        busy, idle = _tenants_on_each_partition(worker_settings.partitions)
        per_tenant = policy_factory(id="per-tenant", unit="input_tokens", limit=10**9)
        overall = policy_factory(id="overall", unit="input_tokens", limit=10**9, group_by=[])
        await apply_policies(per_tenant, overall)
        answers: Counter[int] = Counter()
        unvouched: list[tuple[float, str]] = []
        started = time.monotonic()

        async def admit(tenant: str) -> None:
            reply = await admission_client.post(
                "/v1/admit",
                json={
                    "request_id": uuid.uuid4().hex,
                    "subject": {"tenant": tenant, "model": "m1"},
                    "estimate": {"input_tokens": 1},
                },
            )
            answers[reply.status_code] += 1
            if reply.status_code == 503:
                unvouched.append((time.monotonic() - started, reply.text))

        topic = worker_settings.topic("usage")
        for _ in range(CYCLES):
            # The idle tenant's partition gets nothing for IDLE_S (> the bound) while the
            # busy one is admitted every 50 ms (its reserves keep its partition busy).
            gap_end = time.monotonic() + IDLE_S
            while time.monotonic() < gap_end:
                await admit(busy)
                await asyncio.sleep(0.05)
            # Then one record on the idle partition, and admits of both for 2 s.
            record = commit_factory(tenant=idle, input_tokens=1).model_dump_json().encode()
            await produce(worker_settings.kafka_bootstrap, topic, [(idle.encode(), record)])
            after = time.monotonic() + 2.0
            while time.monotonic() < after:
                await admit(busy)
                await admit(idle)
                await asyncio.sleep(0.02)
        assert sum(answers.values()) > 200, answers
        assert unvouched == [], f"{len(unvouched)} of {sum(answers.values())}: {unvouched[:3]}"
        assert set(answers) == {200}, answers
