"""Scenario 3: Redis stopped and restarted empty (or flushed) while load goes on.

During the outage admission follows each policy's failure mode (closed: 503, open:
admit, degraded: at most the allowance per process); afterwards ``spendgate replay``
(``streams.replay.replay``) rebuilds windows equal to the exact ledger: everything
before the outage, everything produced during it, and every reservation admitted
without Redis.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from schemas.policies import Policy
from streams.policy_admin import publish_policies
from streams.replay import replay
from streams.settings import WorkerSettings
from tests.faults.conftest import (
    AdmissionProcs,
    FaultRecord,
    all_windows,
    compare,
)
from tests.fixtures.admission import OwnRedis
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, produce
from tests.fixtures.pipeline import Workers
from tests.fixtures.workload import generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SCENARIO = 3


async def _apply(settings: WorkerSettings, client: redis.Redis, *policies: Policy) -> None:
    await publish_policies(settings, list(policies))
    wanted = {p.id for p in policies}
    await eventually(
        lambda: wanted <= {k.decode() for k in client.hkeys(f"{settings.redis_prefix}policies")},
        what="policies materialized",
    )


def _policies(policy_factory: PolicyFactory) -> dict[str, Policy]:
    common: dict[str, Any] = {
        "unit": "input_tokens", "limit": 1000, "window": "1h", "bucket": "1m",
        "group_by": ["tenant"],
    }  # fmt: skip
    return {
        "workload": policy_factory(id="load", **{**common, "limit": 10**12},
                                   match={"model": "m"}),
        "closed": policy_factory(id="mode-closed", failure="closed",
                                 match={"model": "m1", "env": "c"}, **common),
        "open": policy_factory(id="mode-open", failure="open",
                               match={"model": "m1", "env": "o"}, **common),
        "degraded": policy_factory(id="mode-degraded", failure="degraded",
                                   degraded_allowance=0.1, match={"model": "m1", "env": "d"},
                                   **common),
    }  # fmt: skip


async def _admit(http: httpx.AsyncClient, env: str, amount: int) -> httpx.Response:
    return await http.post(
        "/v1/admit",
        json={
            "request_id": uuid.uuid4().hex,
            "subject": {"tenant": "acme", "model": "m1", "env": env},
            "estimate": {"input_tokens": amount},
        },
    )


@pytest.fixture
def own_settings(worker_settings: WorkerSettings, own_redis: OwnRedis) -> WorkerSettings:
    return worker_settings.model_copy(update={"redis_url": own_redis.url})


@pytest.fixture
def own_workers(own_settings: WorkerSettings, tmp_path: Path) -> Iterator[Workers]:
    """Worker processes on this test's topics and its private Redis."""
    factory = Workers(own_settings, tmp_path)
    yield factory
    factory.stop_all()


class TestRedisLoss:
    async def test_outage_follows_failure_modes_and_replay_rebuilds_the_windows(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        tmp_path: Path,
        fault_record: FaultRecord,
    ) -> None:
        settings = own_settings
        client = redis.Redis.from_url(own_redis.url)
        policies = _policies(policy_factory)
        work = generate(policies["workload"], 2000, now_ms=int(time.time() * 1000), seed=303)
        half = len(work.records) // 2
        workers = own_workers
        try:
            workers.start()
            await _apply(settings, client, *policies.values())
            proc = admission_procs.start(
                kafka_bootstrap=settings.kafka_bootstrap,
                redis_url=own_redis.url,
                topic_prefix=settings.topic_prefix,
                redis_prefix=settings.redis_prefix,
                extra_env={"SPENDGATE_REDIS_TIMEOUT_S": "0.25"},
            )
            topic = settings.topic("usage")
            await produce(settings.kafka_bootstrap, topic, work.records[:half])
            async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
                for env in ("c", "o", "d"):
                    answer = await _admit(http, env, 20)
                    assert answer.status_code == 200, answer.text
                # Before the outage: the three reservations are counted in Redis.
                await eventually(
                    lambda: all(
                        sum(all_windows(client, settings.redis_prefix).get(
                            f"mode-{m}|tenant=acme", {}).values()) == 20
                        for m in ("closed", "open", "degraded")
                    ),
                    timeout_s=120,
                    what="reservations counted before the outage",
                )  # fmt: skip
                snapshot_before = all_windows(client, settings.redis_prefix)

                # The outage, with load going on: the second half of the usage records is
                # produced and admits keep arriving for every failure mode.
                own_redis.stop()
                fault_record.fault("redis-server stopped (SIGTERM) during load")
                load = asyncio.create_task(
                    produce(settings.kafka_bootstrap, topic, work.records[half:])
                )
                during: dict[str, Counter[str]] = {e: Counter() for e in ("c", "o", "d")}
                admitted_units: Counter[str] = Counter()
                fallback_headers: Counter[str] = Counter()
                for _ in range(5):
                    for env in ("c", "o", "d"):
                        answer = await _admit(http, env, 30)
                        during[env][str(answer.status_code)] += 1
                        fallback_headers[answer.headers.get("Spendgate-Fallback", "-")] += 1
                        if answer.status_code == 200:
                            admitted_units[env] += 30
                await load
                fault_record.fault(
                    f"{len(work.records) - half} usage records produced and 15 admits sent "
                    "while Redis was down"
                )
                own_redis.start()  # empty: no persistence, as after a crash or a FLUSHALL
                fault_record.fault("redis-server restarted empty (all windows and policies lost)")
                await asyncio.sleep(1.5)
                # What admission does right after Redis returns empty.
                after_restart = await _admit(http, "c", 5000)  # 5x the closed policy's limit
        finally:
            workers.stop_all()
        lost_before_replay = compare(client, settings.redis_prefix, work.expected)
        summary = await replay(settings)
        fault_record.fault("workers stopped; `spendgate replay` (streams.replay.replay) run")
        rebuilt = compare(client, settings.redis_prefix, work.expected)
        windows = all_windows(client, settings.redis_prefix)
        expected_modes = {
            m: sum(snapshot_before.get(f"mode-{m}|tenant=acme", {}).values())
            + admitted_units[e]
            # The over-limit admit right after the empty restart (see the xfail below).
            + (5000 if m == "closed" and after_restart.status_code == 200 else 0)
            for m, e in (("closed", "c"), ("open", "o"), ("degraded", "d"))
        }
        got_modes = {
            m: sum(windows.get(f"mode-{m}|tenant=acme", {}).values())
            for m in ("closed", "open", "degraded")
        }
        fault_record.add(
            events_checked=len(work.records) + 3 + 15,
            outage_answers={f"{e} ({m})": dict(during[e]) for e, m in
                            (("c", "closed"), ("o", "open"), ("d", "degraded"))},
            outage_fallback_headers=dict(fallback_headers),
            outage_admitted_units=dict(admitted_units),
            admit_over_limit_right_after_empty_restart=after_restart.status_code,
            over_limit_units=4000 if after_restart.status_code == 200 else 0,
            windows_wrong_before_replay=lost_before_replay.cells_differing,
            replay_records=summary.records,
            replay_outcomes=summary.outcomes,
            units_expected=rebuilt.units_expected,
            units_lost=rebuilt.units_lost,
            units_double_counted=rebuilt.units_double_counted,
            reservation_units_expected=expected_modes,
            reservation_units_rebuilt=got_modes,
        )  # fmt: skip
        assert during["c"] == Counter({"503": 5})
        assert during["o"] == Counter({"200": 5})
        # degraded: 10% of 1000 = 100 per process and window: three admits of 30 fit.
        assert during["d"] == Counter({"200": 3, "429": 2})
        assert rebuilt.exact, rebuilt
        assert got_modes == expected_modes

    async def test_after_a_flush_admission_still_enforces(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        tmp_path: Path,
        fault_record: FaultRecord,
    ) -> None:
        settings = own_settings
        client = redis.Redis.from_url(own_redis.url)
        policy = _policies(policy_factory)["closed"]
        workers = own_workers
        answers: Counter[str] = Counter()
        try:
            workers.start()
            await _apply(settings, client, policy)
            proc = admission_procs.start(
                kafka_bootstrap=settings.kafka_bootstrap,
                redis_url=own_redis.url,
                topic_prefix=settings.topic_prefix,
                redis_prefix=settings.redis_prefix,
            )
            async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
                assert (await _admit(http, "c", 5000)).status_code == 429  # over the limit
                client.flushdb()  # this test's private redis-server only
                fault_record.fault("FLUSHDB on the worker's and admission's (private) Redis")
                await asyncio.sleep(5)  # ten policy-publish ticks of the worker
                for _ in range(5):
                    answer = await _admit(http, "c", 5000)
                    answers[str(answer.status_code)] += 1
        finally:
            workers.stop_all()
        fault_record.add(
            events_checked=5,
            over_limit_admits_after_flush=dict(answers),
            # The limit is 1000 and nothing else was charged: all beyond it is over.
            over_limit_units=max(0, 5000 * answers["200"] - 1000),
        )
        assert answers["200"] == 0
