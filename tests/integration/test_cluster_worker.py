"""A real worker on a real Redis Cluster: windows on their virtual shards, the marks on every
shard's copy; replay restores a wiped cluster and verifies it."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime

import pytest
import redis
from redis.cluster import RedisCluster

from spendgate.devcluster import LocalCluster
from spendgate.schemas.layout import Layout
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import marks_key, window_key
from spendgate.schemas.window_codec import decode
from spendgate.streams.policy_admin import publish_policies
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.kafka_io import eventually, produce
from tests.fixtures.pipeline import Workers, settings_env

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

TENANTS = [f"ct{i}" for i in range(10)]


def _sum(client: RedisCluster, name: str) -> int:
    raw = client.get(name)
    return sum(decode(raw).buckets.values()) if isinstance(raw, bytes) else 0


async def test_a_worker_writes_the_cluster_and_replay_restores_it(
    worker_settings: WorkerSettings, workers: Workers, redis_cluster: LocalCluster
) -> None:
    s = worker_settings
    cluster_env = {"SPENDGATE_REDIS_URL": redis_cluster.url, "SPENDGATE_REDIS_CLUSTER": "true"}
    base = {"unit": "requests", "limit": 10_000, "window": "1h"}
    per_tenant = Policy.model_validate({**base, "id": "c-tenant", "group_by": ["tenant"]})
    per_model = Policy.model_validate({**base, "id": "c-model", "group_by": ["model"]})
    await publish_policies(s, [per_tenant, per_model])
    sent: Counter[str] = Counter()
    records = []
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    for i in range(120):
        tenant, model = TENANTS[i % len(TENANTS)], f"m{i % 3}"
        sent[f"c-tenant|tenant={tenant}"] += 1
        sent[f"c-model|model={model}"] += 1
        body = (
            f'{{"event_id":"e{i}","kind":"commit","occurred_at":"{now}",'
            f'"subject":{{"tenant":"{tenant}",'
            f'"model":"{model}"}},"usage":{{"requests":1}}}}'
        )
        records.append((tenant.encode(), body.encode()))
    await produce(s.kafka_bootstrap, s.topic("usage"), records)
    layout = Layout(s.redis_prefix, cluster=True)
    policies = {p.id: p for p in (per_tenant, per_model)}
    names = {k: window_key(layout.of_key(policies[k.split("|")[0]], k), k) for k in sent}
    client = RedisCluster.from_url(redis_cluster.url)
    try:
        workers.start(env=cluster_env)

        def windows_whole() -> bool:
            return all(_sum(client, names[k]) == n for k, n in sent.items())

        await eventually(windows_whole, 120, "every window whole on its shard")
        assert len({n.split("}")[0] for n in names.values()}) > 3, "keys on several shards"
        # Nothing under the untagged prefix: one Redis's names are not used on a cluster.
        assert client.get(window_key(s.redis_prefix, "c-tenant|tenant=ct0")) is None
        # Every shard's copy vouches for the usage partitions.
        fields = {f"usage:{p}".encode() for p in range(s.partitions)}

        def marked() -> bool:
            return all(fields <= set(client.hkeys(marks_key(sh))) for sh in layout.shards())

        await eventually(marked, 60, "the marks on every shard's copy")
        workers.stop_all()
        # Wipe the prefix on every master, then replay restores and verifies it.
        for node in client.get_primaries():
            conn = redis.Redis(host=node.host, port=node.port)
            for name in conn.scan_iter(match=f"{s.redis_prefix}*", count=1000):
                conn.delete(name)
            conn.close()
        assert not windows_whole()
        env = {**settings_env(s), **cluster_env}

        def replay(*args: str) -> None:
            done = subprocess.run(
                [sys.executable, "-m", "spendgate", "replay", *args],
                env=env, capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr

        replay()
        assert windows_whole()
        replay("--verify")
    finally:
        client.close()
