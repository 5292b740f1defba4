"""Worker state bounded by the window, on a real broker and Redis: a hot key, redelivery
after kill -9, producer duplicates within and beyond the horizon, the id set across a
restart and a rebalance, the retention check, and a record whose state cannot be written.

Expectations are computed here from what each test sent, never by the engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from spendgate.schemas.deadletter import DeadLetter
from spendgate.streams.kafka_util import assign, partitions, stop
from spendgate.streams.settings import WorkerSettings
from tests.fixtures import seeds
from tests.fixtures.admission import free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, metric, produce, read_all, window_sum
from tests.fixtures.pipeline import ApplyPolicies, Workers

pytestmark = pytest.mark.integration

MINUTE = 60_000
DAY = 86_400_000


def commit(
    tenant: str, at: datetime, tokens: int, event_id: str | None = None, model: str = "m"
) -> bytes:
    return json.dumps(
        {
            "event_id": event_id or uuid.uuid4().hex,
            "kind": "commit",
            "subject": {"tenant": tenant, "model": model},
            "occurred_at": at.isoformat(),
            "usage": {"input_tokens": tokens},
        }
    ).encode()


async def send(settings: WorkerSettings, values: list[bytes], tenant: str = "acme") -> None:
    await produce(
        settings.kafka_bootstrap, settings.topic("usage"), [(tenant.encode(), v) for v in values]
    )


async def changelog_sizes(settings: WorkerSettings, key: str) -> list[int]:
    """Sizes of every changelog record of ``key``'s table value, in write order."""
    topic = f"{settings.app_id}-keystate-changelog"
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await consumer.start()
    sizes: list[int] = []
    try:
        tps = await partitions(consumer, topic)
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
            batch = await consumer.getmany(*tps, timeout_ms=500)
            for messages in batch.values():
                sizes += [
                    len(m.value or b"") for m in messages if m.key == json.dumps(key).encode()
                ]
    finally:
        await stop(consumer)
    return sizes


class TestHotKey:
    @pytest.mark.timeout(1200)
    async def test_one_key_with_50000_events_over_a_day_stays_flat_and_counts_all(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        workers.start()
        policy = policy_factory(
            unit="input_tokens", limit=10**12, window="24h", bucket="1m", group_by=["tenant"]
        )
        await apply_policies(policy)
        # This run's seed (SPENDGATE_TEST_SEED reproduces it): a new workload every run.
        rng = seeds.rng("bounded-state-hot-key")
        now = datetime.now(UTC)
        # Spread over the last 23 h, so nothing ages out while the test runs.
        events = [
            commit("hot", now - timedelta(milliseconds=rng.randrange(23 * 3_600_000)), t)
            for t in (rng.randint(1, 100) for _ in range(50_000))
        ]
        expected = sum(json.loads(e)["usage"]["input_tokens"] for e in events)
        await send(worker_settings, events, tenant="hot")
        key = f"{policy.id}|tenant=hot"
        prefix = worker_settings.redis_prefix
        await eventually(
            lambda: window_sum(redis_sync, prefix, key) >= expected,
            timeout_s=1000,
            what="all 50,000 events of the hot key counted",
        )
        assert window_sum(redis_sync, prefix, key) == expected
        assert workers.procs[0].poll() is None, "the worker died"
        sizes = await changelog_sizes(worker_settings, key)
        # One table write per batch of the key's records (the fold), at most 1,000 each.
        assert len(sizes) >= 50_000 / worker_settings.batch_size
        # A 24 h window of 1 min buckets: at most 1,440 buckets, 11.5 KB dense.
        assert max(sizes) <= 16_384
        tenth = len(sizes) // 10
        assert max(sizes[-tenth:]) <= 1.1 * max(sizes[tenth : 2 * tenth])


class TestRedelivery:
    @pytest.mark.timeout(900)
    async def test_kill_9_mid_stream_then_restart_counts_every_event_once(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        first = workers.start("w1")
        policy = policy_factory(unit="input_tokens", limit=10**12, window="1h", bucket="1m")
        await apply_policies(policy)
        now = datetime.now(UTC)
        tenants = [f"t{i}" for i in range(8)]
        sent: dict[str, int] = dict.fromkeys(tenants, 0)
        values: dict[str, list[bytes]] = {t: [] for t in tenants}
        for i in range(4_000):
            tenant = tenants[i % len(tenants)]
            tokens = 1 + i % 37
            sent[tenant] += tokens
            values[tenant].append(commit(tenant, now - timedelta(seconds=i % 600), tokens))
        for tenant in tenants:
            await send(worker_settings, values[tenant], tenant=tenant)
        prefix = worker_settings.redis_prefix

        def counted() -> int:
            return sum(window_sum(redis_sync, prefix, f"{policy.id}|tenant={t}") for t in tenants)

        total = sum(sent.values())
        await eventually(lambda: counted() >= total // 3, timeout_s=300, what="a third counted")
        at_kill = counted()
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert 0 < at_kill < total, "the kill must land mid-stream"
        port = free_port()
        workers.start("w2", metrics_port=port)
        await eventually(lambda: counted() >= total, timeout_s=600, what="every event counted")
        await asyncio.sleep(2)  # a double count would keep growing past the total
        assert counted() == total
        for t in tenants:
            assert window_sum(redis_sync, prefix, f"{policy.id}|tenant={t}") == sent[t]
        # Faust commits offsets on an interval, so records after the last commit were
        # read again: the keys recognised them by position.
        await eventually(
            lambda: metric(port, 'spendgate_keyed_records_total{outcome="redelivery"}') > 0,
            timeout_s=30,
            what="redeliveries seen by the restarted worker",
        )


class TestProducerDuplicates:
    async def test_within_the_horizon_once_beyond_it_again(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        # A horizon set explicitly shorter than the window (the worker warns): 8 s.
        workers.start(env={"SPENDGATE_DEDUPE_HORIZON": "8s"})
        policy = policy_factory(unit="input_tokens", limit=10**9, window="1h", bucket="1m")
        await apply_policies(policy)
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        now = datetime.now(UTC)
        originals = [commit("acme", now, 10) for _ in range(20)]
        sent_at = time.monotonic()
        await send(worker_settings, originals + originals)  # each twice, at once
        marker = commit("acme", now, 1)  # read after every copy: the check waits for it
        await send(worker_settings, [marker])
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 201, timeout_s=120)
        # Past the horizon (arrival time), the same ids count again.
        await asyncio.sleep(max(0.0, sent_at + 10.0 - time.monotonic()))
        await send(worker_settings, [*originals[:5], commit("acme", now, 1)])
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 252, timeout_s=120)
        await asyncio.sleep(2)
        assert window_sum(redis_sync, prefix, key) == 252


class TestIdSetRecovery:
    @pytest.mark.parametrize("fresh_disk", [False, True], ids=["same-disk", "fresh-disk"])
    async def test_duplicates_after_a_restart_count_nothing(
        self,
        fresh_disk: bool,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        tmp_path: Path,
    ) -> None:
        first = workers.start("w1")
        policy = policy_factory(unit="input_tokens", limit=10**9, window="1h", bucket="1m")
        await apply_policies(policy)
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        now = datetime.now(UTC)
        originals = [commit("acme", now, 10) for _ in range(100)]
        await send(worker_settings, originals)
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 1_000, timeout_s=120)
        first.terminate()
        first.wait(timeout=60)
        # A fresh disk has neither table nor id set: the table comes back from its
        # changelog, the ids from re-reading the topic.
        workers.start("w2", data_dir=tmp_path / "fresh" if fresh_disk else None)
        await send(worker_settings, [*originals, commit("acme", now, 7)])
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 1_007, timeout_s=180)
        await asyncio.sleep(2)  # anything still in flight would show now
        assert window_sum(redis_sync, prefix, key) == 1_007

    async def test_a_rebalance_keeps_watermarks_and_ids(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        port_a, port_b = free_port(), free_port()
        workers.start("a", worker_settings.data_dir / "a", metrics_port=port_a)
        policy = policy_factory(unit="input_tokens", limit=10**9, window="1h", bucket="1m")
        # Keys of one tenant are accounted in the tenant's usage partition, a key spanning
        # tenants on the keyed topic: both states must follow their partitions.
        overall = policy_factory(
            unit="input_tokens", limit=10**9, window="1h", bucket="1m", group_by=[]
        )
        await apply_policies(policy, overall)
        tenants = [f"t{i}" for i in range(6)]
        prefix = worker_settings.redis_prefix
        now = datetime.now(UTC)
        originals = {t: [commit(t, now, 10) for _ in range(50)] for t in tenants}
        for t in tenants:
            await send(worker_settings, originals[t], tenant=t)

        def sums() -> list[int]:
            return [window_sum(redis_sync, prefix, f"{policy.id}|tenant={t}") for t in tenants]

        await eventually(
            lambda: sums() == [500] * 6 and window_sum(redis_sync, prefix, overall.id) == 3000,
            timeout_s=120,
        )
        workers.start("b", worker_settings.data_dir / "b", metrics_port=port_b)

        def owns_usage(port: int) -> bool:
            return metric(port, "spendgate_consumer_offset") > 0

        # Duplicates and new events keep coming while the group rebalances.
        ones = dict.fromkeys(tenants, 0)
        for _ in range(60):
            for t in tenants:
                await send(worker_settings, [*originals[t][:2], commit(t, now, 1)], tenant=t)
                ones[t] += 1
            if owns_usage(port_b):
                break
            await asyncio.sleep(1)
        assert owns_usage(port_b), "the second worker never got a usage partition"
        for t in tenants:
            await send(worker_settings, originals[t] + [commit(t, now, 1)], tenant=t)
            ones[t] += 1
        # Every duplicate counted nothing; each 1-token event once.
        expected = [500 + ones[t] for t in tenants]

        def exact() -> bool:
            return sums() == expected and window_sum(redis_sync, prefix, overall.id) == sum(
                expected
            )

        try:
            await eventually(exact, timeout_s=180, what="exact sums")
        except AssertionError as failure:
            seen = (sums(), window_sum(redis_sync, prefix, overall.id))
            raise AssertionError(f"{failure}: saw {seen}, expected {expected}") from None
        await asyncio.sleep(3)
        assert exact(), (sums(), window_sum(redis_sync, prefix, overall.id))


class TestRetention:
    async def test_a_usage_topic_shorter_than_the_windows_is_refused(
        self,
        worker_settings: WorkerSettings,
        policy_factory: PolicyFactory,
        tmp_path: Path,
    ) -> None:
        from spendgate.streams.policy_admin import publish_policies

        admin = AIOKafkaAdminClient(bootstrap_servers=worker_settings.kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_topics(
                [
                    NewTopic(
                        worker_settings.topic("usage"),
                        2,
                        1,
                        topic_configs={"retention.ms": str(3_600_000)},
                    )
                ]
            )
        finally:
            await admin.close()
        await publish_policies(worker_settings, [policy_factory(window="24h", bucket="1m")])
        env = {
            **os.environ,
            "SPENDGATE_KAFKA_BOOTSTRAP": worker_settings.kafka_bootstrap,
            "SPENDGATE_REDIS_URL": worker_settings.redis_url,
            "SPENDGATE_TOPIC_PREFIX": worker_settings.topic_prefix,
            "SPENDGATE_APP_ID": worker_settings.app_id,
            "SPENDGATE_DATA_DIR": str(tmp_path / "tables"),
            "SPENDGATE_METRICS_PORT": "0",
        }
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "spendgate", "worker"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 2, out
        topic = worker_settings.topic("usage")
        # 24 h window + 24 h horizon = 172,800,000 ms needed, 3,600,000 kept.
        assert topic in out and "3600000" in out and "172800000" in out, out
        assert "CreateTime" in out  # the topic was made without LogAppendTime: reported


class TestUnwritable:
    async def test_a_record_whose_state_would_be_too_large_is_dead_lettered(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        port = free_port()
        # 2 KiB per value on purpose: about 150 sparse buckets fit, 400 do not.
        workers.start(metrics_port=port, env={"SPENDGATE_MAX_VALUE_BYTES": "2048"})
        policy = policy_factory(unit="input_tokens", limit=10**9, window="1h", bucket="1s")
        await apply_policies(policy)
        now = datetime.now(UTC).replace(microsecond=0)
        wide = [commit("acme", now - timedelta(seconds=2 * i), 1) for i in range(400)]
        await send(worker_settings, wide)
        # A second policy only for model m2: the last event counts there (and on the first
        # policy, where its bucket already exists, so it fits).
        other = policy_factory(
            unit="input_tokens", limit=10**9, window="1h", bucket="1m", match={"model": "m2"}
        )
        await apply_policies(policy, other)
        await send(worker_settings, [commit("acme", now, 1, model="m2")])
        # The worker goes on: the next event is counted on the other policy's key.
        await eventually(
            lambda: (
                window_sum(redis_sync, worker_settings.redis_prefix, f"{other.id}|tenant=acme") == 1
            ),
            timeout_s=180,
            what="the worker still counting",
        )
        assert workers.procs[0].poll() is None
        dead = [
            DeadLetter.model_validate_json(v)
            for v in await read_all(worker_settings.kafka_bootstrap, worker_settings.topic("dlq"))
        ]
        too_large = [d for d in dead if "max_value_bytes 2048" in d.reason]
        counted = window_sum(redis_sync, worker_settings.redis_prefix, f"{policy.id}|tenant=acme")
        # Every event is either in the window or dead-lettered: nothing silently lost.
        assert too_large and counted + len(too_large) == 401
        # A tenant's key is accounted in its usage partition: the usage record itself.
        assert all(d.topic == worker_settings.topic("usage") for d in too_large)
        assert metric(port, "spendgate_unwritable_records_total") == len(too_large)
