"""Streaming reservations end to end: admission, Kafka, the worker, replay (real services)."""

from __future__ import annotations

import subprocess
import uuid
from datetime import UTC, datetime

import httpx
import pytest
import redis

from spendgate.admission.client import AsyncAdmissionClient
from spendgate.schemas.events import Usage
from spendgate.schemas.redis_keys import window_key
from spendgate.streams.replay import replay
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import free_port
from tests.fixtures.consumption import wait_consumed
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import buckets, eventually, pending_sum, read_alerts, window_sum
from tests.fixtures.pipeline import ApplyPolicies, Workers

pytestmark = pytest.mark.integration

SUBJECT = {"tenant": "acme", "model": "m1"}


async def _admit(http: httpx.AsyncClient, output_tokens: int) -> httpx.Response:
    body = {
        "request_id": uuid.uuid4().hex,
        "subject": SUBJECT,
        "estimate": {"output_tokens": output_tokens},
    }
    return await http.post("/v1/admit", json=body)


def _client(http: httpx.AsyncClient) -> AsyncAdmissionClient:
    return AsyncAdmissionClient(str(http.base_url), transport=http._transport)


class TestStreaming:
    async def test_a_stream_stopped_by_a_refused_extend_commits_what_it_used(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(unit="output_tokens", limit=1000, window="1m", bucket="5s")
        await apply_policies(policy)
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        client = _client(admission_client)
        produced = 0
        async with client.stream(SUBJECT, {"output_tokens": 300}, {"output_tokens": 250}) as s:
            for produced in range(100, 5001, 100):
                if not await s.report(Usage(output_tokens=produced)):
                    break
        # Reserved 300, then 550 and 800; at 900 the extend to 1,050 was refused.
        assert s.stopped and produced == 900
        assert s.reserved == Usage(output_tokens=800)
        assert s.refusal is not None and s.refusal["violated"] == [policy.id]
        assert s.refusal["budgets"][0]["remaining"] == 200
        # The window shows exactly what the stream used, once the worker absorbed it all.
        await eventually(
            lambda: (
                pending_sum(redis_sync, prefix, key) == 0
                and window_sum(redis_sync, prefix, key) == 900
            ),
            what="the window holds the 900 committed",
        )

    async def test_retried_extends_count_once_and_replay_rebuilds_the_windows(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        small = policy_factory(unit="output_tokens", limit=500, window="1m", bucket="5s")
        big = policy_factory(unit="output_tokens", limit=100_000, window="1m", bucket="5s")
        await apply_policies(small, big)
        keys = [f"{p.id}|tenant=acme" for p in (small, big)]
        prefix = worker_settings.redis_prefix
        admitted = await _admit(admission_client, 100)
        rid = admitted.json()["reservation_id"]

        async def extend(seq: int, n: int) -> httpx.Response:
            body = {"reservation_id": rid, "seq": seq, "add": {"output_tokens": n}}
            return await admission_client.post("/v1/extend", json=body)

        for _ in range(3):  # a retried extend: applied once
            assert (await extend(1, 150)).status_code == 200
        refused = await extend(2, 300)  # 250 + 300 > 500 on the small budget only
        assert refused.status_code == 429
        assert refused.json()["violated"] == [small.id]
        assert (await extend(3, 50)).status_code == 200
        await eventually(
            lambda: (
                [pending_sum(redis_sync, prefix, k) for k in keys] == [0, 0]
                and [window_sum(redis_sync, prefix, k) for k in keys] == [300, 300]
            ),
            what="the reservation and its two extends absorbed, on both budgets",
        )
        commit = await admission_client.post(
            "/v1/commit", json={"reservation_id": rid, "usage": {"output_tokens": 280}}
        )
        assert commit.status_code == 202
        await eventually(
            lambda: [window_sum(redis_sync, prefix, k) for k in keys] == [280, 280],
            what="the commit replaced the reservation",
        )
        before = {k: buckets(redis_sync, prefix, k) for k in keys}
        worker.terminate()
        worker.wait(timeout=30)
        redis_sync.delete(*(window_key(prefix, k) for k in keys))
        summary = await replay(worker_settings)
        assert summary.outcomes == {"applied": 8}  # reserve, 2 extends, commit, per key
        assert {k: buckets(redis_sync, prefix, k) for k in keys} == before


class TestOverage:
    async def test_a_commit_above_its_reservation_is_charged_counted_and_alerted(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        port = free_port()
        workers.start(metrics_port=port)
        policy = policy_factory(
            unit="output_tokens", limit=10_000, window="1h", bucket="1m", overage="cap_next"
        )
        await apply_policies(policy)
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        admitted = await _admit(admission_client, 100)
        rid = admitted.json()["reservation_id"]
        before = datetime.now(UTC)
        commit = await admission_client.post(
            "/v1/commit", json={"reservation_id": rid, "usage": {"output_tokens": 250}}
        )
        assert commit.status_code == 202
        await eventually(
            lambda: (
                pending_sum(redis_sync, prefix, key) == 0
                and window_sum(redis_sync, prefix, key) == 250
            ),
            what="charged in full",
        )
        alerts = await read_alerts(
            worker_settings.kafka_bootstrap, worker_settings.topic("alerts"), kind="overage"
        )
        assert len(alerts) == 1
        alert = alerts[0]
        assert (alert.policy, alert.key, alert.reservation_id) == (policy.id, key, rid)
        assert (alert.estimate, alert.reserved, alert.actual) == (100, 100, 250)
        assert alert.at >= before.replace(microsecond=0)
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        assert f'spendgate_overage_total{{policy="{policy.id}"}} 1.0' in text
        assert f'spendgate_overage_amount_total{{policy="{policy.id}"}} 150.0' in text
        # cap_next: the key's next estimate is held at the observed ratio (2.5, decaying
        # over the 1 h window: a few seconds later it is still about 2.5).
        nxt = await _admit(admission_client, 100)
        assert nxt.status_code == 200, nxt.text
        (budget,) = nxt.json()["budgets"]
        assert budget["used"] == 250
        assert 248 <= budget["reserved"] <= 250
        # Once the worker has read everything (the reserve of the admit above too), the
        # topic still holds exactly one overage alert, and it is the one a replay of the
        # usage topic derives (same id, same content), not only one the product's id
        # function would give.
        await wait_consumed(
            worker_settings.kafka_bootstrap, worker_settings.app_id, worker_settings.topic("usage")
        )
        again = await read_alerts(
            worker_settings.kafka_bootstrap,
            worker_settings.topic("alerts"),
            at_least=2,
            kind="overage",
            timeout_s=3.0,  # long enough for a second copy in flight to land
        )
        assert [a.alert_id for a in again] == [alert.alert_id]
        summary = await replay(worker_settings, verify=True)
        (replayed,) = [a for a in summary.alerts if a.kind == "overage"]
        assert replayed.alert_id == alert.alert_id
        assert replayed == alert
