"""The dashboard's reads on a real Redis Cluster: every shard's utilization index merged by
share, windows read on their shards, filters and details as on one Redis."""

from __future__ import annotations

import time

import pytest
from redis.asyncio.cluster import RedisCluster

from spendgate.dashboard.reader import BudgetReader
from spendgate.schemas.layout import Layout
from spendgate.schemas.policies import Policy
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.fold import KeyWrite
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

TENANT = Policy.model_validate(
    {"id": "per-tenant", "limit": 100, "unit": "requests", "window": "1h",
     "group_by": ["tenant"]}
)  # fmt: skip
MODEL = Policy.model_validate(
    {"id": "per-model", "limit": 1000, "unit": "requests", "window": "1h",
     "group_by": ["model"]}
)  # fmt: skip
POLICIES = {p.id: p for p in (TENANT, MODEL)}


def _write(key: str, used: int, now_ms: int) -> KeyWrite:
    bucket = now_ms // 60_000 * 60_000
    state = KeyState(buckets={bucket: used}, bucket_ms=60_000, window_ms=3_600_000)
    state.high_ms = now_ms
    state.offsets = {0: 1}
    return KeyWrite(key, state, WindowSpec(3_600_000, 60_000), True, True)


async def test_pages_merge_every_shard_by_share(
    cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    client, prefix = cluster_client, cluster_prefix
    layout = Layout(prefix, cluster=True)
    m = RedisMaterializer(
        client,  # type: ignore[arg-type]
        prefix,
        limit_of=lambda pid: p.limit if (p := POLICIES.get(pid)) else None,
        layout=layout,
        policy_of=POLICIES.get,
    )
    now_ms = int(time.time() * 1000)
    used = {f"team-{i}": 5 * i + 3 for i in range(12)}
    writes = [_write(f"per-tenant|tenant={t}", n, now_ms) for t, n in used.items()]
    writes.append(_write("per-model|model=m1", 455, now_ms))
    try:
        await m.write_policies(POLICIES.values())
        await m.write_batch(writes)
        shards = {layout.home_shard(t) for t in used}
        assert len(shards) > 3, "the tenants should span several shards"
        reader = BudgetReader(client, prefix, layout)  # type: ignore[arg-type]
        everyone = lambda _tenant: True  # noqa: E731
        # By share, highest first, across shards: the oracle is what was written.
        shares = sorted(
            [(n / 100, f"per-tenant|tenant={t}") for t, n in used.items()]
            + [(455 / 1000, "per-model|model=m1")],
            reverse=True,
        )
        first = await reader.page(everyone, limit=5)
        assert first.matched == 13
        assert [r.key for r in first.rows] == [k for _, k in shares[:5]]
        second = await reader.page(everyone, offset=5, limit=5)
        assert [r.key for r in second.rows] == [k for _, k in shares[5:10]]
        # Filtered by policy (names only), still by share across shards.
        tenants = await reader.page(everyone, policy="per-tenant", limit=50)
        assert [r.key for r in tenants.rows] == [k for _, k in shares if "tenant=" in k]
        assert [r.used for r in tenants.rows] == sorted(used.values(), reverse=True)
        one = await reader.page(everyone, tenant="team-4")
        assert [(r.key, r.used) for r in one.rows] == [("per-tenant|tenant=team-4", 23)]
        found = await reader.detail("per-model|model=m1")
        assert found is not None and found[0].used == 455
    finally:
        async for key in client.scan_iter(match=f"{prefix}*", count=1000):
            await client.delete(key)
