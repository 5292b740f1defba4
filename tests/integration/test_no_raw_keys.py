"""No raw API key at rest: after a workload with API keys, every Redis key and value and
every record of every topic is scanned for the raw keys the test sent.

The first test drives the real admission (its app with the key ids of its settings) and
the real worker with admits, refusals, commits, releases, extends, alerts and a policy
matching one key exactly; the second is the upgrade: records written raw by an older
version (and a malformed one), the prefix wiped, rebuilt by a worker under a new app id.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from aiokafka import AIOKafkaConsumer

from spendgate.streams.policy_admin import publish_policies
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.consumption import wait_consumed
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import (
    eventually,
    pending_sum,
    produce,
    read_records,
    wait_refusals,
    window_sum,
)
from tests.fixtures.key_ids import key_id
from tests.fixtures.pipeline import ApplyPolicies, Workers, settings_env

pytestmark = pytest.mark.integration


def redis_dump(client: redis.Redis, prefix: str) -> list[bytes]:
    """Every key under ``prefix`` and everything stored in it, as bytes."""
    out: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        out.append(key)
        kind = client.type(key).decode()
        if kind == "string":
            out.append(client.get(key) or b"")
        elif kind == "hash":
            for k, v in client.hgetall(key).items():
                out += [k, v]
        elif kind == "zset":
            out += [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "set":
            out += list(client.smembers(key))
        elif kind == "list":
            out += client.lrange(key, 0, -1)
        elif kind == "stream":
            for _, fields in client.xrange(key):
                for k, v in fields.items():
                    out += [k, v]
        else:
            raise AssertionError(f"unexpected Redis type {kind} at {key!r}")
    return out


async def topic_dump(bootstrap: str, prefix: str) -> dict[str, list[bytes]]:
    """Every record (key, value, headers) of every topic whose name starts with ``prefix``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        names = sorted(t for t in await consumer.topics() if t.startswith(prefix))
    finally:
        await consumer.stop()
    out: dict[str, list[bytes]] = {}
    for name in names:
        found: list[bytes] = []
        for rec in await read_records(bootstrap, name):
            found += [rec.key or b"", rec.value or b""]
            found += [v for _, v in rec.headers or ()]
        out[name] = found
    return out


def worker_logs(folder: Path) -> list[bytes]:
    return [p.read_bytes() for p in folder.glob("worker-*.log")]


def holders(blobs: list[bytes], secret: str) -> list[bytes]:
    return [b for b in blobs if secret.encode() in b]


class TestNoRawKeyAtRest:
    async def test_a_workload_with_api_keys_leaves_only_key_ids(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
        tmp_path: Path,
    ) -> None:
        tag = uuid.uuid4().hex[:10]
        raw = {"a": f"sk-live-A-{tag}", "b": f"sk-live-B-{tag}"}
        per_key = policy_factory(
            limit=500, unit="input_tokens", group_by=["tenant", "api_key"], alerts=[0.5, 0.8]
        )
        only_a = policy_factory(limit=300, unit="input_tokens", match={"api_key": raw["a"]})
        await apply_policies(per_key, only_a)
        violated: dict[str, set[str]] = {"a": set(), "b": set()}
        refused: set[str] = set()  # request ids answered 429
        for step in range(12):
            for name, value in raw.items():
                answer = await admission_client.post(
                    "/v1/admit",
                    json={
                        "request_id": f"{name}-{step}-{tag}",
                        "subject": {"tenant": "t1", "api_key": value, "model": "m1"},
                        "estimate": {"input_tokens": 50},
                    },
                )
                assert answer.status_code in (200, 429), answer.text
                body = answer.json()
                assert raw["a"] not in answer.text and raw["b"] not in answer.text
                if answer.status_code == 429:
                    violated[name].update(body["violated"])
                    refused.add(f"{name}-{step}-{tag}")
                    continue
                reservation = body["reservation_id"]
                if step % 3 == 0:
                    grown = await admission_client.post(
                        "/v1/extend",
                        json={"reservation_id": reservation, "seq": 1, "add": {"input_tokens": 5}},
                    )
                    assert grown.status_code in (200, 429), grown.text
                if step % 4 == 1:
                    done = await admission_client.post(
                        "/v1/release", json={"reservation_id": reservation}
                    )
                else:
                    done = await admission_client.post(
                        "/v1/commit",
                        json={"reservation_id": reservation, "usage": {"input_tokens": 60}},
                    )
                assert done.status_code in (200, 202), done.text
        # The exact match on the secret field works on key ids: only key a met its policy.
        assert only_a.id in violated["a"] and only_a.id not in violated["b"]
        looked_up = await admission_client.get(
            "/v1/budgets", params={"tenant": "t1", "api_key": raw["a"]}
        )
        assert looked_up.status_code == 200, looked_up.text
        keys = {b["key"] for b in looked_up.json()["budgets"]}
        assert keys == {
            f"{per_key.id}|tenant=t1|api_key={key_id(raw['a'])}",
            f"{only_a.id}|tenant=t1",
        }

        prefix = worker_settings.redis_prefix
        for value in raw.values():
            key = f"{per_key.id}|tenant=t1|api_key={key_id(value)}"
            await eventually(lambda k=key: pending_sum(redis_sync, prefix, k) == 0, 60.0)
            assert window_sum(redis_sync, prefix, key) > 0
        # Everything written before the scan: every refusal admission answered (sent in the
        # background after a linger) on the refusals topic, and the worker's group at the end
        # of the topics it reads (a record's alerts, dead letters and changelog writes are
        # acked before its offset is committed).
        await wait_refusals(
            worker_settings.kafka_bootstrap, worker_settings.topic("refusals"), refused
        )
        await wait_consumed(
            worker_settings.kafka_bootstrap,
            worker_settings.app_id,
            worker_settings.topic("usage"),
            timeout_s=60.0,
        )

        stored = redis_dump(redis_sync, prefix)
        topics = await topic_dump(worker_settings.kafka_bootstrap, worker_settings.topic_prefix)
        expected = {"usage", "refusals", "alerts", "policies"}
        assert {worker_settings.topic(n) for n in expected} <= set(topics)
        assert any(worker_settings.topic("alerts") == t and v for t, v in topics.items())
        assert any(b for b in topics[worker_settings.topic("refusals")])
        assert any(t.endswith("changelog") for t in topics), sorted(topics)
        logs = worker_logs(tmp_path)
        for value in raw.values():
            assert holders(stored, value) == []
            for name, blobs in topics.items():
                assert holders(blobs, value) == [], name
            assert holders(logs, value) == []
            # What is there instead: the key id, in Redis and on the usage topic.
            assert holders(stored, key_id(value))
            assert holders(topics[worker_settings.topic("usage")], key_id(value))

    async def test_an_upgrade_rebuilds_raw_records_under_key_ids(
        self,
        worker_settings: WorkerSettings,
        workers: Workers,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        """Records an older version wrote raw; its Redis keys raw. After the upgrade steps
        (wipe the prefix, a worker under a new app id) the windows are whole under the ids,
        replay --verify agrees, and no raw value is in Redis or on any topic spendgate
        writes."""
        tag = uuid.uuid4().hex[:10]
        raw, broken = f"sk-old-{tag}", f"sk-broken-{tag}"
        policy = policy_factory(limit=10_000, unit="requests", group_by=["tenant", "api_key"])
        s = worker_settings
        await publish_policies(s, [policy])
        now = "2026-01-01T00:00:00Z"
        records = [
            (
                b"t1",
                (
                    f'{{"event_id":"old-{i}-{tag}","kind":"commit","occurred_at":"{now}",'
                    f'"subject":{{"tenant":"t1","api_key":"{raw}"}},"usage":{{"requests":1}}}}'
                ).encode(),
            )
            for i in range(7)
        ]
        bad = f'{{"event_id":"x-{tag}","kind":"commit","subject":{{"api_key":"{broken}"}}}}'
        records.append((b"t1", bad.encode()))
        await produce(s.kafka_bootstrap, s.topic("usage"), records)
        env = settings_env(s)

        def replay(*args: str, **more: str) -> None:
            done = subprocess.run(
                [sys.executable, "-m", "spendgate", "replay", *args],
                env={**env, **more},
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert done.returncode == 0, done.stdout + done.stderr

        # Before: what an older version kept (no secret fields), raw in Redis.
        replay(SPENDGATE_SECRET_FIELDS="")
        old_key = f"{policy.id}|tenant=t1|api_key={raw}"
        assert window_sum(redis_sync, s.redis_prefix, old_key) == 7
        # The upgrade (README, "Upgrading to key ids"): wipe the prefix, start the worker
        # under a new app id (fresh tables and changelogs): it folds the usage topic again,
        # under key ids.
        for key in redis_sync.scan_iter(match=f"{s.redis_prefix}*", count=1000):
            redis_sync.delete(key)
        new_key = f"{policy.id}|tenant=t1|api_key={key_id(raw)}"
        dlq = s.topic("dlq")

        async def dead_lettered() -> bool:
            return any(
                key_id(broken).encode() in (r.value or b"")
                for r in await read_records(s.kafka_bootstrap, dlq)
            )

        workers.start()
        rebuilt = "the worker rebuilt the window under the key id"
        await eventually(lambda: window_sum(redis_sync, s.redis_prefix, new_key) == 7, 120, rebuilt)
        # Its own writes: the dead letter carries the malformed record with the key id.
        for _ in range(120):
            if await dead_lettered():
                break
            await asyncio.sleep(0.5)
        assert await dead_lettered(), "no dead letter with the key id"
        stored = redis_dump(redis_sync, s.redis_prefix)
        assert holders(stored, raw) == [] and holders(stored, broken) == []
        assert window_sum(redis_sync, s.redis_prefix, old_key) == 0
        workers.stop_all()
        # A replay under the new setting finds the same windows (and restores a lost Redis).
        replay("--verify")
        topics = await topic_dump(s.kafka_bootstrap, s.topic_prefix)
        for name, blobs in topics.items():
            if name == s.topic("usage"):
                continue  # the old records themselves: the log is not rewritten
            assert holders(blobs, raw) == [] and holders(blobs, broken) == [], name
