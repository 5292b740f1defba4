"""Simulate agrees with enforcement: a live workload through the real admission and worker,
then ``spendgate simulate`` over its log with the policy in force as the draft.

Two tenants on one 30 s policy, one admit each per step (400 each). Tenant ``same`` commits
every admitted request at its estimate: a commit then changes no amount, so the view live
admission decides on (absorbed + pending) is at every instant the view simulate folds, and
the refused request ids must be the same set, exactly.

Tenant ``differ`` commits actuals that differ from the estimates. Live admission decides on
the estimate until the worker has absorbed the commit, while simulate applies the commit at
its instant (a caveat simulate states). The guarantee then: a request can be decided
differently only when the two views differ at its instant, which needs a differing commit
not yet absorbed live (its log-append time after the worker's applied watermark, read just
before the admit: *exposed*), or an earlier request decided differently whose amount still
counts (within window + bucket before it). The test asserts every disagreement is so
explained, and prints both refused counts and the number of exposed requests.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from typing import Any

import httpx
import orjson
import pytest
import redis

from spendgate.schemas.events import parse_event
from spendgate.simulate import read_history
from spendgate.simulation import Simulation
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, pending_sum
from tests.fixtures.pipeline import ApplyPolicies
from tests.fixtures.seeds import derive

pytestmark = pytest.mark.integration

STEPS = 400
STEP_S = 0.075  # 400 steps: about 30 s, one window
WINDOW_MS, BUCKET_MS = 30_000, 1_000


def _applied_watermark(client: redis.Redis, prefix: str) -> int:
    """The oldest applied mark (ms): every record appended at or before it is in Redis."""
    marks = client.hvals(f"{prefix}marks")
    return min((int(m) for m in marks), default=0)


class TestSimulateLive:
    async def test_simulate_refuses_what_admission_refused(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(limit=6000, unit="input_tokens", window="30s", bucket="1s")
        await apply_policies(policy)
        rng = random.Random(derive("test_simulate_live"))
        prefix = worker_settings.redis_prefix
        refused: dict[str, set[str]] = {"same": set(), "differ": set()}
        request_of: dict[str, str] = {}  # reservation id -> request id
        #: differ's reservations committed at another amount than their estimate.
        differing: set[str] = set()
        #: differ's requests -> the applied watermark read just before the admit.
        watermark: dict[str, int] = {}
        for step in range(STEPS):
            started = time.monotonic()
            for tenant in ("same", "differ"):
                rid = f"{tenant}-{step}"
                estimate = rng.randrange(20, 121)
                if tenant == "differ":
                    watermark[rid] = _applied_watermark(redis_sync, prefix)
                answer = await admission_client.post(
                    "/v1/admit",
                    json={
                        "request_id": rid,
                        "subject": {"tenant": tenant, "model": "m1"},
                        "estimate": {"input_tokens": estimate},
                    },
                )
                assert answer.status_code in (200, 429), answer.text
                if answer.status_code == 429:
                    refused[tenant].add(rid)
                    continue
                reservation = answer.json()["reservation_id"]
                request_of[reservation] = rid
                actual = estimate if tenant == "same" else rng.randrange(0, 2 * estimate)
                commit: dict[str, Any] = {
                    "reservation_id": reservation,
                    "usage": {"input_tokens": actual},
                }
                done = await admission_client.post("/v1/commit", json=commit)
                assert done.status_code in (200, 202), done.text
                if actual != estimate:
                    differing.add(reservation)
            await asyncio.sleep(max(0.0, STEP_S - (time.monotonic() - started)))

        # Everything published and absorbed, then simulate over the log.
        for tenant in ("same", "differ"):
            key = f"{policy.id}|tenant={tenant}"
            await eventually(lambda k=key: pending_sum(redis_sync, prefix, k) == 0, 60.0)
        await asyncio.sleep(1.0)  # the refusals' linger
        records = await read_history(worker_settings)
        sim = Simulation([policy], None, worker_settings.horizon_ms(policy.window_ms))
        try:
            for item in records:
                sim.feed(item)
            sim.finish()
        finally:
            sim.close()
        simulated = sim.refused_requests | {request_of[r] for r in sim.refused_reservations}
        sim_refused = {t: {r for r in simulated if r.startswith(f"{t}-")} for t in refused}
        at_of, commits = _timeline(records, request_of, differing)
        # A differing commit before the request, appended after the watermark read for it.
        exposed = {
            rid
            for rid, mark in watermark.items()
            if any(occurred < at_of[rid] and appended > mark for occurred, appended in commits)
        }

        print(
            f"\nsame: {len(refused['same'])} refused live, {len(sim_refused['same'])} simulated"
            f"\ndiffer: {len(refused['differ'])} refused live, "
            f"{len(sim_refused['differ'])} simulated, {len(exposed)} of {STEPS} exposed, "
            f"{len(sim_refused['differ'] ^ refused['differ'])} decided differently"
        )
        assert refused["same"], "the workload never reached the limit"
        assert sim_refused["same"] == refused["same"]

        disagree = sorted(sim_refused["differ"] ^ refused["differ"], key=lambda r: at_of[r])
        reach = WINDOW_MS + BUCKET_MS
        for i, rid in enumerate(disagree):
            earlier = [d for d in disagree[:i] if at_of[rid] - at_of[d] < reach]
            assert rid in exposed or earlier, (rid, at_of[rid])


def _timeline(
    records: list[Any], request_of: dict[str, str], differing: set[str]
) -> tuple[dict[str, int], list[tuple[int, int]]]:
    """Each request's decision instant (the Redis clock: its reserve's or its refusal's),
    and the (event ms, log-append ms) of each differing commit."""
    at_of: dict[str, int] = {}
    commits: list[tuple[int, int]] = []
    for item in records:
        raw = orjson.loads(item.value)
        if item.topic == 1 and "request_id" in raw:
            at_of.setdefault(str(raw["request_id"]), item.at_ms)
            continue
        if item.topic != 0 or raw.get("reservation_id") is None:
            continue
        event = parse_event(item.value)
        reservation = str(event.reservation_id)
        if event.kind == "reserve" and reservation in request_of:
            at_of.setdefault(request_of[reservation], item.at_ms)
        elif event.kind == "commit" and reservation in differing:
            commits.append((item.at_ms, item.broker_ms))
    return at_of, commits
