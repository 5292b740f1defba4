"""Scenario 3: Redis stopped and restarted empty (or flushed) while load goes on.

During the outage admission follows each policy's failure mode (closed: 503, open:
admit, degraded: at most the allowance per process); afterwards ``spendgate replay``
(``streams.replay.replay``) rebuilds windows equal to the exact ledger: everything
before the outage, everything produced during it, and every reservation admitted
without Redis.

After Redis comes back empty (restart without persistence, or FLUSHDB), the probes use
an estimate that *fits an empty window* but not the real one (900 of 1,000 used, 200
asked): a decision on the wiped window admits it, so an over-admit fails the test. While
the worker is stalled (SIGSTOP) nothing can make the window known again, so the only
honest answer is 503 ``state_unvouched`` with ``state: missing`` (closed: the state cannot
be vouched for); 200 would be a decision on the wiped window (issue 16 defect 2, fixed by
the applied marks the admission script checks: ``schemas.shards``). Once the worker has
rewritten the windows and caught up, exactly 429 for 200 and 200 for the 100 that fit.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from spendgate.schemas.policies import Policy
from spendgate.streams.policy_admin import publish_policies
from spendgate.streams.replay import replay
from spendgate.streams.settings import WorkerSettings
from tests.faults.conftest import (
    AdmissionProcs,
    FaultRecord,
    all_windows,
    compare,
    read_buckets,
)
from tests.fixtures.admission import OwnRedis
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, pending_sum, produce
from tests.fixtures.pipeline import Workers, all_marked
from tests.fixtures.workload import generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SCENARIO = 3


async def _apply(settings: WorkerSettings, client: redis.Redis, *policies: Policy) -> None:
    await publish_policies(settings, list(policies))
    wanted = {p.id for p in policies}
    await eventually(
        lambda: (
            wanted <= {k.decode() for k in client.hkeys(f"{settings.redis_prefix}policies")}
            and all_marked(client, settings.redis_prefix)
        ),
        what="policies materialized, every partition vouched for",
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


#: Already charged on the closed policy's key before Redis loses its data (limit 1,000).
USED = 900
#: Fits an empty window (200 <= 1,000), not the real one (900 + 200 > 1,000).
PROBE = 200
CLOSED_KEY = "mode-closed|tenant=acme"


async def _charge_closed(settings: WorkerSettings, client: redis.Redis, amount: int) -> None:
    """A direct commit of ``amount`` on the closed policy's key, counted by the worker."""
    body = {
        "schema_version": 1,
        "event_id": uuid.uuid4().hex,
        "kind": "commit",
        "occurred_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "subject": {"tenant": "acme", "model": "m1", "env": "c"},
        "usage": {"input_tokens": amount},
    }
    await produce(settings.kafka_bootstrap, settings.topic("usage"),
                  [(b"acme", json.dumps(body).encode())])  # fmt: skip
    await eventually(
        lambda: sum(read_buckets(client, settings.redis_prefix, CLOSED_KEY).values()) == amount,
        timeout_s=120,
        what=f"{amount} units counted on {CLOSED_KEY}",
    )


def _unvouched(answer: httpx.Response) -> dict[str, Any]:
    """The error's ``code`` and ``state`` of an answer ({} when it has no error body)."""
    try:
        error = answer.json().get("error") or {}
    except ValueError:
        return {}
    return {k: error.get(k) for k in ("code", "state")} if error else {}


async def _ready(http: httpx.AsyncClient) -> bool:
    return (await http.get("/readyz")).status_code == 200


async def _closed_used(http: httpx.AsyncClient) -> int | None:
    """``used`` of the closed key as admission reports it (GET /v1/budgets), or None
    while its window is not vouched for (``state`` set)."""
    answer = await http.get("/v1/budgets", params={"tenant": "acme", "model": "m1", "env": "c"})
    if answer.status_code != 200:
        return None
    for item in answer.json().get("budgets", []):
        if item["key"] == CLOSED_KEY and item.get("state") is None:
            return int(item["used"])
    return None


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
        work = generate(policies["workload"], 2000, now_ms=int(time.time() * 1000),
                        seed="redis-loss")  # fmt: skip
        half = len(work.records) // 2
        workers = own_workers
        reserve_before = 20
        try:
            workers.start()
            await _apply(settings, client, *policies.values())
            proc = admission_procs.start(
                kafka_bootstrap=settings.kafka_bootstrap,
                redis_url=own_redis.url,
                topic_prefix=settings.topic_prefix,
                redis_prefix=settings.redis_prefix,
            )
            topic = settings.topic("usage")
            await produce(settings.kafka_bootstrap, topic, work.records[:half])
            async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
                for env in ("c", "o", "d"):
                    answer = await _admit(http, env, reserve_before)
                    assert answer.status_code == 200, answer.text
                # Before the outage: the three reservations are counted in Redis.
                await eventually(
                    lambda: all(
                        sum(all_windows(client, settings.redis_prefix).get(
                            f"mode-{m}|tenant=acme", {}).values()) == reserve_before
                        for m in ("closed", "open", "degraded")
                    ),
                    timeout_s=120,
                    what="reservations counted before the outage",
                )  # fmt: skip

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
        finally:
            workers.stop_all()
        summary = await replay(settings)
        fault_record.fault("workers stopped; `spendgate replay` (streams.replay.replay) run")
        mode_keys = {f"mode-{m}|tenant=acme" for m in ("closed", "open", "degraded")}
        # The failure-mode keys' buckets follow the server clock: their totals are checked
        # apart (got_modes below); every other window under the prefix is the ledger's.
        rebuilt = compare(client, settings.redis_prefix, work.expected, checked_apart=mode_keys)
        windows = all_windows(client, settings.redis_prefix)
        # From what this test was told was admitted: the reservation before the outage
        # plus every 200 during it (their reserve events were published to the log).
        expected_modes = {
            m: reserve_before + admitted_units[e]
            for m, e in (("closed", "c"), ("open", "o"), ("degraded", "d"))
        }
        got_modes = {
            m: sum(windows.get(f"mode-{m}|tenant=acme", {}).values())
            for m in ("closed", "open", "degraded")
        }
        admitted_events = 3 + sum(during[e]["200"] for e in ("c", "o", "d"))
        fault_record.add(
            events_checked=len(work.records) + 3 + 15,
            outage_answers={f"{e} ({m})": dict(during[e]) for e, m in
                            (("c", "closed"), ("o", "open"), ("d", "degraded"))},
            outage_fallback_headers=dict(fallback_headers),
            outage_admitted_units=dict(admitted_units),
            over_limit_units=sum(max(0, v - 1000) for v in got_modes.values()),
            replay_records=summary.records,
            replay_outcomes=summary.outcomes,
            units_expected=rebuilt.units_expected,
            units_held=rebuilt.units_held,
            units_lost=rebuilt.units_lost,
            units_double_counted=rebuilt.units_double_counted,
            reservation_units_expected=expected_modes,
            reservation_units_rebuilt=got_modes,
        )  # fmt: skip
        # Redis down: closed never decides (503); open admits every request; degraded
        # admits up to 10% of 1,000 = 100 per process and window, so three of 30 fit.
        assert during["c"] == Counter({"503": 5})
        assert during["o"] == Counter({"200": 5})
        assert during["d"] == Counter({"200": 3, "429": 2})
        # Fallback answers say so; a closed 503 is an error answer and carries none.
        assert fallback_headers == Counter({"-": 5, "open": 5, "degraded": 5})
        assert admitted_units == Counter({"o": 150, "d": 90})
        # Over the limit: nothing (every key holds at most 20 + 150 of 1,000).
        assert all(v <= 1000 for v in got_modes.values())
        # The replay read every record: the workload and one reserve per 200 answer.
        assert summary.records == len(work.records) + admitted_events
        # Each record the test sent matches one policy: every one not re-sent and not older
        # than the window is applied once, and nothing else happens to any record.
        assert set(summary.outcomes) <= {"applied", "late_dropped"}, summary.outcomes
        assert summary.outcomes["applied"] == (
            len(work.records) - work.duplicates - work.ancient + admitted_events
        )
        assert (
            summary.duplicates + summary.outcomes.get("late_dropped", 0)
            == work.duplicates + work.ancient
        )
        assert rebuilt.units_held == work.units()
        assert rebuilt.keys_missing == rebuilt.keys_unexpected == ()
        assert (rebuilt.units_lost, rebuilt.units_double_counted) == (0, 0)
        assert rebuilt.exact, rebuilt
        assert got_modes == expected_modes

    async def test_right_after_an_empty_restart_admission_does_not_decide_on_the_wiped_window(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        settings = own_settings
        client = redis.Redis.from_url(own_redis.url)
        worker = own_workers.start()
        await _apply(settings, client, _policies(policy_factory)["closed"])
        proc = admission_procs.start(
            kafka_bootstrap=settings.kafka_bootstrap,
            redis_url=own_redis.url,
            topic_prefix=settings.topic_prefix,
            redis_prefix=settings.redis_prefix,
        )
        await _charge_closed(settings, client, USED)
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            await eventually_async(lambda: _closed_used(http), USED, "admission sees 900 used")
            # The worker is stalled, so no rewrite can race the probe: what admission
            # answers here is its own decision on the state Redis holds.
            worker.send_signal(signal.SIGSTOP)
            try:
                own_redis.stop()
                own_redis.start()  # empty: no persistence
                fault_record.fault("worker stalled (SIGSTOP); redis-server restarted empty")
                # Admission reaches Redis again (a refusal while it cannot is no proof).
                await eventually_async(lambda: _ready(http), True, "admission ready again")
                answer = await _admit(http, "c", PROBE)
            finally:
                worker.send_signal(signal.SIGCONT)
        fault_record.add(
            events_checked=1,
            probe=f"{PROBE} on a limit of 1000 with {USED} used",
            probe_status=answer.status_code,
            probe_error=_unvouched(answer),
            over_limit_units=USED + PROBE - 1000 if answer.status_code == 200 else 0,
        )
        # The worker is stalled and Redis empty: nothing can have made the window known
        # again, so the closed policy's only answer is 503, the state missing.
        assert answer.status_code == 503, answer.text
        assert _unvouched(answer) == {"code": "state_unvouched", "state": "missing"}

    async def test_right_after_a_flush_admission_does_not_decide_on_the_wiped_window(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        settings = own_settings
        client = redis.Redis.from_url(own_redis.url)
        worker = own_workers.start()
        await _apply(settings, client, _policies(policy_factory)["closed"])
        proc = admission_procs.start(
            kafka_bootstrap=settings.kafka_bootstrap,
            redis_url=own_redis.url,
            topic_prefix=settings.topic_prefix,
            redis_prefix=settings.redis_prefix,
        )
        await _charge_closed(settings, client, USED)
        answers: Counter[int] = Counter()
        errors: Counter[str] = Counter()
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            await eventually_async(lambda: _closed_used(http), USED, "admission sees 900 used")
            worker.send_signal(signal.SIGSTOP)
            try:
                client.flushdb()  # this test's private redis-server only
                fault_record.fault("worker stalled (SIGSTOP); FLUSHDB on the private Redis")
                for _ in range(3):
                    answer = await _admit(http, "c", PROBE)
                    answers[answer.status_code] += 1
                    errors[json.dumps(_unvouched(answer), sort_keys=True)] += 1
            finally:
                worker.send_signal(signal.SIGCONT)
        fault_record.add(
            events_checked=3,
            probe=f"{PROBE} on a limit of 1000 with {USED} used",
            probe_statuses=dict(answers),
            probe_errors=dict(errors),
            over_limit_units=(USED + PROBE * answers[200] - 1000) if answers[200] else 0,
        )
        # The worker is stalled and Redis flushed: nothing can have made the window known
        # again, so every answer of the closed policy is 503, the state missing.
        assert answers == Counter({503: 3}), answers
        unvouched = {"code": "state_unvouched", "state": "missing"}
        assert errors == Counter({json.dumps(unvouched, sort_keys=True): 3}), errors

    async def test_after_a_flush_the_worker_rewrites_windows_and_policies(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        settings = own_settings
        client = redis.Redis.from_url(own_redis.url)
        own_workers.start()
        await _apply(settings, client, _policies(policy_factory)["closed"])
        proc = admission_procs.start(
            kafka_bootstrap=settings.kafka_bootstrap,
            redis_url=own_redis.url,
            topic_prefix=settings.topic_prefix,
            redis_prefix=settings.redis_prefix,
        )
        await _charge_closed(settings, client, USED)
        before = read_buckets(client, settings.redis_prefix, CLOSED_KEY)
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            await eventually_async(lambda: _closed_used(http), USED, "admission sees 900 used")
            client.flushdb()  # this test's private redis-server only
            flushed = time.monotonic()
            fault_record.fault("FLUSHDB on the worker's and admission's (private) Redis")
            # No admit until the rewrite: the condition is the window itself, back in Redis
            # from the worker's table, then admission reporting it.
            await eventually(
                lambda: (
                    read_buckets(client, settings.redis_prefix, CLOSED_KEY) == before
                    and client.hexists(f"{settings.redis_prefix}policies", "mode-closed")
                ),
                timeout_s=60,
                what="windows and policies rewritten by the worker",
            )
            rewritten_s = time.monotonic() - flushed
            await eventually_async(lambda: _closed_used(http), USED, "admission sees 900 again")
            over = await _admit(http, "c", PROBE)  # 900 + 200 > 1000
            fits = await _admit(http, "c", 1000 - USED)  # 900 + 100 = 1000: fits exactly
        fault_record.add(
            events_checked=2,
            rewrite_seconds=round(rewritten_s, 1),
            over_probe_status=over.status_code,
            fitting_probe_status=fits.status_code,
            over_limit_units=PROBE if over.status_code == 200 else 0,
            pending_after=pending_sum(client, settings.redis_prefix, CLOSED_KEY),
        )
        assert over.status_code == 429, over.text
        assert fits.status_code == 200, fits.text
        assert pending_sum(client, settings.redis_prefix, CLOSED_KEY) == 1000 - USED
        # The worker checks its marker every 0.5 s; on a loaded 2-core box allow 10 s.
        assert rewritten_s < 10


async def eventually_async(read: Any, want: Any, what: str, timeout_s: float = 60.0) -> None:
    """Poll the coroutine function ``read`` until it returns ``want``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        last = await read()
        if last == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {timeout_s}s (last {last!r})")
        await asyncio.sleep(0.2)


#: Each racing admit asks this much; 100 of room (1,000 - 900) fits exactly ten.
RACE_AMOUNT = 10
RACERS = 200


class TestUnvouchedWindows:
    async def test_a_flush_under_200_racing_admits_admits_nothing_over_the_limit(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        settings = own_settings
        client = redis.Redis.from_url(own_redis.url)
        own_workers.start()
        await _apply(settings, client, _policies(policy_factory)["closed"])
        proc = admission_procs.start(
            kafka_bootstrap=settings.kafka_bootstrap,
            redis_url=own_redis.url,
            topic_prefix=settings.topic_prefix,
            redis_prefix=settings.redis_prefix,
        )
        await _charge_closed(settings, client, USED)
        answers: Counter[int] = Counter()
        gate = asyncio.Semaphore(20)
        flushed = asyncio.Event()

        async def racer(http: httpx.AsyncClient, n: int) -> None:
            async with gate:
                if n == RACERS // 4:
                    client.flushdb()  # this test's private redis-server only
                    flushed.set()
                answers[(await _admit(http, "c", RACE_AMOUNT)).status_code] += 1

        async with httpx.AsyncClient(base_url=proc.url, timeout=60) as http:
            await eventually_async(lambda: _closed_used(http), USED, "admission sees 900 used")
            await asyncio.gather(*(racer(http, n) for n in range(RACERS)))
            fault_record.fault(
                f"FLUSHDB on the private Redis after {RACERS // 4} of {RACERS} racing admits "
                f"of {RACE_AMOUNT} (closed policy, {USED} of 1,000 used) had started"
            )
            # The worker restores and catches up; then admission vouches for the window
            # again and reports what it holds.
            admitted = RACE_AMOUNT * answers[200]
            await eventually_async(
                lambda: _closed_used(http), USED + admitted, "the admitted reserves absorbed"
            )
        held = sum(read_buckets(client, settings.redis_prefix, CLOSED_KEY).values())
        fault_record.add(
            events_checked=RACERS,
            racing_statuses=dict(answers),
            units_admitted=admitted,
            window_after=held,
            over_limit_units=max(0, USED + admitted - 1000),
        )
        assert flushed.is_set()
        assert set(answers) <= {200, 429, 503}, answers
        assert sum(answers.values()) == RACERS
        # Never more than the room left, and every admitted unit is in the window.
        assert max(0, USED + admitted - 1000) == 0
        assert held == USED + admitted

    async def test_a_stopped_worker_makes_its_windows_stale_and_the_failure_mode_answers(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        settings = own_settings
        client = redis.Redis.from_url(own_redis.url)
        worker = own_workers.start()
        await _apply(settings, client, *_policies(policy_factory).values())
        staleness_s = 3.0
        proc = admission_procs.start(
            kafka_bootstrap=settings.kafka_bootstrap,
            redis_url=own_redis.url,
            topic_prefix=settings.topic_prefix,
            redis_prefix=settings.redis_prefix,
            extra_env={"SPENDGATE_STALENESS_S": str(staleness_s)},
        )
        statuses: dict[str, int] = {}
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            await eventually_async(lambda: _closed_used(http), 0, "admission vouches")
            worker.send_signal(signal.SIGSTOP)
            try:
                fault_record.fault(f"worker stopped (SIGSTOP) for {staleness_s + 2:.0f} s")
                await asyncio.sleep(staleness_s + 2)
                stale = {env: await _admit(http, env, 1) for env in ("c", "o", "d")}
            finally:
                worker.send_signal(signal.SIGCONT)
            fault_record.fault("worker resumed (SIGCONT)")
            await eventually_async(lambda: _closed_used(http), 0, "admission vouches again")
            back = await _admit(http, "c", 1)
        statuses = {f"stale {env}": a.status_code for env, a in stale.items()}
        fault_record.add(
            events_checked=4,
            statuses={**statuses, "closed after resume": back.status_code},
            closed_state=stale["c"].json()["error"]["state"],
            open_state=stale["o"].json()["state"],
            degraded_fallback=stale["d"].headers["Spendgate-Fallback"],
        )
        assert statuses == {"stale c": 503, "stale o": 200, "stale d": 200}
        assert stale["c"].json()["error"]["state"] == "stale"
        assert stale["o"].json()["state"] == "stale"
        assert stale["d"].headers["Spendgate-Fallback"] == "degraded"
        assert back.status_code == 200, back.text
