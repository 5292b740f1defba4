"""The worker's Redis writes on a real Redis Cluster: each key on its virtual shard, the
marks, their owners and the presence on every shard's copy (``streams.materialize``)."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from spendgate.schemas.layout import Layout
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import (
    mark_owners_key,
    marks_key,
    policies_key,
    utilization_key,
    window_key,
)
from spendgate.schemas.window_codec import decode
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.fold import KeyWrite
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.scripts.mark import MarkWrite

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

TENANT = Policy.model_validate(
    {"id": "per-tenant", "limit": 100, "unit": "requests", "window": "1h",
     "group_by": ["tenant"]}
)  # fmt: skip
GLOBAL = Policy.model_validate(
    {"id": "per-model", "limit": 1000, "unit": "requests", "window": "1h",
     "group_by": ["model"]}
)  # fmt: skip
POLICIES = {p.id: p for p in (TENANT, GLOBAL)}


def _write(key: str, buckets: dict[int, int], version: int) -> KeyWrite:
    state = KeyState(buckets=buckets, bucket_ms=60_000, window_ms=3_600_000)
    state.high_ms = max(buckets) + 1
    state.offsets = {0: version - 1}
    return KeyWrite(key, state, WindowSpec(3_600_000, 60_000), True, True)


def _materializer(client: RedisCluster, prefix: str) -> RedisMaterializer:
    return RedisMaterializer(
        client,  # type: ignore[arg-type]
        prefix,
        limit_of=lambda pid: p.limit if (p := POLICIES.get(pid)) else None,
        layout=Layout(prefix, cluster=True),
        policy_of=POLICIES.get,
    )


async def _wipe(client: RedisCluster, prefix: str) -> None:
    keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
    for key in keys:
        await client.delete(key)


async def test_windows_go_to_their_shards_and_marks_to_every_copy(
    cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    client, prefix = cluster_client, cluster_prefix
    layout = Layout(prefix, cluster=True)
    m = _materializer(client, prefix)
    tenants = [f"acme-{i}" for i in range(12)]
    writes = [_write(f"per-tenant|tenant={t}", {0: 10 + i}, 5) for i, t in enumerate(tenants)]
    writes.append(_write("per-model|model=m1", {0: 500}, 3))
    me = f"{prefix}worker:a"
    try:
        await m.write_policies(POLICIES.values())
        claims = await m.claim(["usage:0", "keyed:0"], me)
        assert {c.token for c in claims.values()} == {1}
        marks = [MarkWrite("usage:0", 1, 1_000), MarkWrite("keyed:0", 1, 2_000)]
        reply = await m.write_batch(writes, marks, me)
        assert reply is not None and reply.present and not reply.fenced
        shards = set()
        for i, t in enumerate(tenants):
            key = f"per-tenant|tenant={t}"
            shard = layout.shard(layout.home_shard(t))
            shards.add(shard)
            raw = await client.get(window_key(shard, key))
            assert raw is not None and sum(decode(raw).buckets.values()) == 10 + i
            score = await client.zscore(utilization_key(shard), window_key(shard, key))
            assert score == pytest.approx((10 + i) / 100)
            assert await client.get(window_key(prefix, key)) is None  # never untagged
        assert len(shards) > 1, "12 tenants should span several shards"
        model_shard = layout.of_key(GLOBAL, "per-model|model=m1")
        assert await client.get(window_key(model_shard, "per-model|model=m1")) is not None
        # The marks on every shard's copy, the policies on the control shard.
        for shard in layout.shards():
            assert await client.hgetall(marks_key(shard)) == {
                b"usage:0": b"1000",
                b"keyed:0": b"2000",
            }, shard
        assert await client.hget(policies_key(layout.control), "per-tenant") is not None
    finally:
        await _wipe(client, prefix)


async def test_a_new_owner_fences_the_old_one_on_every_copy(
    cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    client, prefix = cluster_client, cluster_prefix
    layout = Layout(prefix, cluster=True)
    m = _materializer(client, prefix)
    old, new = f"{prefix}worker:old", f"{prefix}worker:new"
    try:
        await m.claim(["usage:3"], old)
        assert (await m.write_marks([MarkWrite("usage:3", 1, 1_000)], old)).written == 1
        (claim,) = (await m.claim(["usage:3"], new)).values()
        assert (claim.token, claim.mark_ms) == (2, 1_000)
        for shard in layout.shards():
            assert await client.hget(mark_owners_key(shard), "usage:3") == b"2", shard
        # The old owner, resumed: refused on every copy, the mark stays.
        reply = await m.write_marks([MarkWrite("usage:3", 1, 9_000)], old)
        assert (reply.written, reply.fenced) == (0, 1)
        for shard in layout.shards():
            assert await client.hget(marks_key(shard), "usage:3") == b"1000", shard
    finally:
        await _wipe(client, prefix)


async def test_a_shard_that_lost_the_presence_stops_every_mark(
    cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    client, prefix = cluster_client, cluster_prefix
    layout = Layout(prefix, cluster=True)
    m = _materializer(client, prefix)
    me = f"{prefix}worker:a"
    try:
        await m.claim(["usage:0"], me)
        # One shard lost its data (a failover that dropped writes, a wiped node).
        await client.delete(m.presence_on(layout.shard(17), me))
        reply = await m.write_marks([MarkWrite("usage:0", 1, 1_000)], me)
        assert not reply.present
        assert await client.hget(marks_key(layout.shard(17)), "usage:0") is None
        # Claiming again (as the worker then does) sets it everywhere.
        await m.claim(["usage:0"], me)
        assert (await m.write_marks([MarkWrite("usage:0", 2, 1_000)], me)).present
    finally:
        await _wipe(client, prefix)


async def test_heals_and_samples_on_the_cluster(
    cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    client, prefix = cluster_client, cluster_prefix
    layout = Layout(prefix, cluster=True)
    m = _materializer(client, prefix)
    # More keys than the cluster client's 100 connections per node: calls stay bounded.
    keys = [f"per-tenant|tenant=h{i}" for i in range(300)]
    try:
        states = [(k, _write(k, {0: 7}, 4).state) for k in keys]
        assert await m.heal_many(states) == [True] * 300
        assert await m.heal_many(states) == [False] * 300  # nothing differs any more
        for key in keys:
            assert await client.get(window_key(m.shard_of(key), key)) is not None
        await client.hset(marks_key(layout.shard(0)), "usage:1", 42)
        now, marks = await m.sample(["usage:0", "usage:1"])
        assert marks == [None, 42] and now > 0
    finally:
        await _wipe(client, prefix)
