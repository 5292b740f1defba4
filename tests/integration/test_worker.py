"""The stream processor on a real broker and Redis: dead letters, alerts, clamping,
live policy changes, replay."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import redis

from spendgate.schemas.deadletter import DeadLetter
from spendgate.schemas.redis_keys import window_key
from spendgate.streams.replay import replay
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import buckets, eventually, produce, read_alerts, read_all, window_sum
from tests.fixtures.pipeline import ApplyPolicies, Workers

pytestmark = pytest.mark.integration


def event(
    kind: str = "commit", tenant: str = "acme", at: datetime | None = None, **fields: Any
) -> bytes:
    body: dict[str, Any] = {
        "event_id": uuid.uuid4().hex,
        "kind": kind,
        "subject": {"tenant": tenant, "model": "m"},
        "occurred_at": (at or datetime.now(UTC)).isoformat(),
    }
    if kind != "release":
        body["usage"] = fields.pop("usage", {"input_tokens": 10})
    body.update(fields)
    return json.dumps(body).encode()


async def send(settings: WorkerSettings, *values: bytes, key: bytes = b"acme") -> None:
    await produce(settings.kafka_bootstrap, settings.topic("usage"), [(key, v) for v in values])


class TestWorker:
    async def test_malformed_records_are_dead_lettered_and_processing_goes_on(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=10_000)
        await apply_policies(policy)
        bad = [
            b"\xff\xfenot json",
            b'{"kind": "commit"}',
            event(usage={"input_tokens": -1}),
            event(kind="refund"),
            b"[]",
        ]
        await send(worker_settings, *bad, event(usage={"input_tokens": 7}))
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 7, what="good event")
        dead: list[DeadLetter] = []
        for _ in range(150):  # the worker's producer sends them asynchronously
            values = await read_all(worker_settings.kafka_bootstrap, worker_settings.topic("dlq"))
            dead = [DeadLetter.model_validate_json(v) for v in values]
            if len(dead) >= len(bad):
                break
            await asyncio.sleep(0.2)
        assert sorted(d.raw for d in dead) == sorted(bad)
        assert all(d.reason and d.topic == worker_settings.topic("usage") for d in dead)
        assert any("usage.input_tokens" in d.reason for d in dead)

    async def test_far_future_events_are_clamped_to_the_broker_time(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=10_000, window="1h", bucket="1m")
        await apply_policies(policy)
        before = datetime.now(UTC)
        await send(worker_settings, event(at=before + timedelta(days=300)))
        key = f"{policy.id}|tenant=acme"
        await eventually(lambda: window_sum(redis_sync, worker_settings.redis_prefix, key) == 10)
        (start,) = buckets(redis_sync, worker_settings.redis_prefix, key)
        assert before - timedelta(minutes=1) <= datetime.fromtimestamp(start / 1000, UTC)
        assert datetime.fromtimestamp(start / 1000, UTC) <= datetime.now(UTC)

    async def test_threshold_alerts_fire_once_and_replay_finds_the_same_ids(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=100, alerts=[0.5, 0.8])
        await apply_policies(policy)
        await send(worker_settings, *(event(usage={"input_tokens": 30}) for _ in range(4)))
        key = f"{policy.id}|tenant=acme"
        await eventually(lambda: window_sum(redis_sync, worker_settings.redis_prefix, key) == 120)

        live = await read_alerts(
            worker_settings.kafka_bootstrap, worker_settings.topic("alerts"), at_least=3
        )
        assert sorted((a.kind, a.threshold) for a in live) == [
            ("exhausted", None),
            ("threshold", 0.5),
            ("threshold", 0.8),
        ]
        rebuilt = await replay(worker_settings, verify=True)
        assert not rebuilt.differences
        assert {a.alert_id for a in rebuilt.alerts} == {a.alert_id for a in live}

    async def test_a_policy_change_takes_effect_without_a_restart(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=100)
        await apply_policies(policy)
        await send(worker_settings, event())
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 10)
        # Counting requests from now on: the window keeps what it had (no reset).
        changed = policy.model_copy(update={"unit": "requests", "limit": 5})
        await apply_policies(changed)
        await eventually(
            lambda: (
                json.loads(redis_sync.hget(f"{prefix}policies", policy.id) or b"{}").get("limit")
                == 5
            )
        )
        await send(worker_settings, event(usage={"requests": 1, "input_tokens": 50}))
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 11)

    async def test_replay_restores_wiped_redis_windows(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=10_000)
        await apply_policies(policy)
        values = [
            event(tenant=t, usage={"input_tokens": n})
            for n, t in enumerate(["a", "b", "c"] * 20, start=1)
        ]
        await send(worker_settings, *values, values[0], values[1])  # with duplicates
        prefix = worker_settings.redis_prefix
        keys = [f"{policy.id}|tenant={t}" for t in "abc"]
        expected = {
            t: sum(n for n, x in enumerate(["a", "b", "c"] * 20, 1) if x == t) for t in "abc"
        }
        await eventually(
            lambda: (
                [window_sum(redis_sync, prefix, k) for k in keys] == [expected[t] for t in "abc"]
            )
        )
        before = {k: buckets(redis_sync, prefix, k) for k in keys}
        worker.terminate()
        worker.wait(timeout=30)
        redis_sync.delete(*(window_key(prefix, k) for k in keys))
        assert (await replay(worker_settings, verify=True)).differences == sorted(keys)
        summary = await replay(worker_settings)
        assert summary.outcomes == {"applied": 60}
        assert summary.duplicates == 2
        assert {k: buckets(redis_sync, prefix, k) for k in keys} == before
        assert not (await replay(worker_settings, verify=True)).differences
        # --from: records before the timestamp are skipped.
        later = await replay(
            worker_settings, since=datetime.now(UTC) + timedelta(hours=1), verify=True
        )
        assert later.records == 0
        earlier = await replay(
            worker_settings, since=datetime.now(UTC) - timedelta(hours=1), verify=True
        )
        assert earlier.records == 62 and not earlier.differences


class TestMetrics:
    async def test_the_worker_exports_counts_lag_and_offsets(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        port = free_port()
        workers.start(metrics_port=port)
        policy = policy_factory(unit="input_tokens", limit=10_000)
        await apply_policies(policy)
        first = event()
        await send(
            worker_settings, first, first, b"junk", event(at=datetime.now(UTC) + timedelta(days=9))
        )
        key = f"{policy.id}|tenant=acme"
        await eventually(lambda: window_sum(redis_sync, worker_settings.redis_prefix, key) == 20)
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text

        def value(name: str) -> float:
            lines = [
                ln
                for ln in text.splitlines()
                if ln.startswith(name + " ") or ln.startswith(name + "{")
            ]
            return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

        assert value('spendgate_events_total{kind="commit",outcome="counted"}') == 2
        assert value('spendgate_events_total{kind="commit",outcome="duplicate"}') == 1
        assert value("spendgate_duplicate_events_total") == 1
        assert value("spendgate_clamped_total") == 1
        assert value("spendgate_dead_lettered_total") == 1
        assert value("spendgate_processing_lag_seconds_count") >= 2
        assert value("spendgate_consumer_offset") >= 3


class TestForecastAlerts:
    async def test_a_forecast_alert_fires_once_and_replay_finds_the_same_id(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens", limit=1000, window="1h", bucket="1m", alerts=[], forecast="30m"
        )
        await apply_policies(policy)
        now = datetime.now(UTC)
        # 300 spent over the last 6 minutes (the burn rate's tenth of the window): ~50 a
        # minute, so the 700 left last ~14 minutes, within the 30 m horizon.
        spent = [event(at=now - timedelta(minutes=m), usage={"input_tokens": 50}) for m in range(6)]
        await send(worker_settings, *reversed(spent))
        key = f"{policy.id}|tenant=acme"
        await eventually(lambda: window_sum(redis_sync, worker_settings.redis_prefix, key) == 300)
        live = await read_alerts(worker_settings.kafka_bootstrap, worker_settings.topic("alerts"))
        (alert,) = live
        assert alert.kind == "forecast" and alert.key == key
        assert alert.exhausts_in_seconds is not None and 0 < alert.exhausts_in_seconds <= 1800
        rebuilt = await replay(worker_settings, verify=True)
        assert [a.alert_id for a in rebuilt.alerts] == [alert.alert_id]
