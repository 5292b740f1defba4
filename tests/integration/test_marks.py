"""The worker's applied marks on a real broker and Redis (``schemas.shards``, ``streams.marks``).

Admission finds the partitions a key depends on by the same hash as the producers: here
the records really on the topics are checked against it, and the marks against the
windows they vouch for.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from datetime import UTC, datetime

import pytest
import redis
from aiokafka import AIOKafkaConsumer

from schemas.redis_keys import marks_key, topology_key
from schemas.shards import Topology, partition_for
from streams.kafka_util import assign, partitions, stop
from streams.settings import WorkerSettings
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, produce, window_sum
from tests.fixtures.pipeline import ApplyPolicies, all_marked

pytestmark = pytest.mark.integration

TENANTS = [f"t{i}" for i in range(12)]


async def _placed(bootstrap: str, topic: str) -> list[tuple[int, bytes]]:
    """(partition, key) of every record in ``topic``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = await partitions(consumer, topic)
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[tuple[int, bytes]] = []
        while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
            for tp, messages in (await consumer.getmany(*tps, timeout_ms=500)).items():
                out += [(tp.partition, m.key or b"") for m in messages]
        return out
    finally:
        await stop(consumer)


def _commit(tenant: str) -> bytes:
    return json.dumps(
        {
            "event_id": uuid.uuid4().hex,
            "kind": "commit",
            "subject": {"tenant": tenant, "model": "m"},
            "occurred_at": datetime.now(UTC).isoformat(),
            "usage": {"input_tokens": 1},
        }
    ).encode()


class TestMarks:
    async def test_records_land_where_admission_looks_for_their_marks(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        per_tenant = policy_factory(id="per-tenant", unit="input_tokens", limit=10**6)
        overall = policy_factory(id="overall", unit="input_tokens", limit=10**6, group_by=[])
        await apply_policies(per_tenant, overall)
        bootstrap = worker_settings.kafka_bootstrap
        await produce(
            bootstrap,
            worker_settings.topic("usage"),
            [(t.encode(), _commit(t)) for t in TENANTS],
        )
        prefix = worker_settings.redis_prefix
        await eventually(
            lambda: window_sum(redis_sync, prefix, "overall") == len(TENANTS),
            what="every commit counted",
        )
        raw = redis_sync.get(topology_key(prefix))
        assert raw is not None
        topo = Topology.decode(raw)
        assert topo == Topology(worker_settings.partitions, worker_settings.partitions)
        usage = await _placed(bootstrap, worker_settings.topic("usage"))
        keyed = await _placed(bootstrap, worker_settings.keyed_topic)
        assert len(usage) == len(TENANTS)
        assert all(p == partition_for(k, topo.usage) for p, k in usage)
        assert len({p for p, _ in usage}) > 1  # the check spans several partitions
        # Only the key spanning tenants crosses the keyed topic (tenant keys stay local).
        assert keyed and {k for _, k in keyed} == {b"overall"}
        assert all(p == partition_for(k, topo.keyed) for p, k in keyed)

    async def test_caught_up_marks_follow_the_redis_clock_and_return_after_a_flush(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(id="marked", unit="input_tokens", limit=10**6)
        await apply_policies(policy)
        bootstrap, prefix = worker_settings.kafka_bootstrap, worker_settings.redis_prefix
        await produce(bootstrap, worker_settings.topic("usage"), [(b"acme", _commit("acme"))])
        key = "marked|tenant=acme"
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 1, what="counted")

        def marks_fresh() -> bool:
            seconds, micros = redis_sync.time()
            now = seconds * 1000 + micros // 1000
            values = redis_sync.hvals(marks_key(prefix))
            return bool(values) and all(now - int(v) < 2_000 for v in values)

        # Idle and caught up: every mark is the present, refreshed every 0.5 s.
        await eventually(marks_fresh, what="marks at the present")
        for k in redis_sync.scan_iter(match=f"{prefix}*"):
            redis_sync.delete(k)
        flushed = time.monotonic()
        # The marks come back only with the window they vouch for.
        while not all_marked(redis_sync, prefix):
            assert time.monotonic() - flushed < 60, "marks did not come back"
            assert (
                redis_sync.hlen(marks_key(prefix)) == 0 or window_sum(redis_sync, prefix, key) == 1
            )
            await asyncio.sleep(0.05)
        assert window_sum(redis_sync, prefix, key) == 1
