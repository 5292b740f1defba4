"""Scenario 4: duplicate delivery and producer retries are counted once.

The same records reach the topic three times (an idempotent producer, then a
non-idempotent producer sending the whole batch twice, as an application-level retry
after a lost ack does), plus same-id records with a different body; admission repeats
the same ``request_id`` and the same commit. The windows must equal the exact ledger,
checked only once the worker's group has read (committed) every copy on the topic: a check
that could turn true on the first copies alone proves nothing about the re-sent ones.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import redis
from aiokafka import AIOKafkaProducer

from spendgate.streams.settings import WorkerSettings
from tests.faults.conftest import FaultRecord, compare, read_buckets
from tests.fixtures.consumption import wait_consumed
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, pending_sum, produce
from tests.fixtures.pipeline import ApplyPolicies, Workers
from tests.fixtures.workload import generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SCENARIO = 4
EVENTS = 3000


async def _produce_plain_twice(
    bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]
) -> int:
    """A non-idempotent producer (acks=1) sending the batch, then the batch again."""
    async with AIOKafkaProducer(
        bootstrap_servers=bootstrap, enable_idempotence=False, acks=1, linger_ms=5
    ) as producer:
        sent = 0
        for _ in range(2):
            futures = [await producer.send(topic, v, key=k) for k, v in records]
            await producer.flush()
            for fut in futures:
                await fut
            sent += len(futures)
        return sent


class TestDuplicates:
    async def test_the_same_records_delivered_three_times_count_once(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens", limit=10**12, window="1h", bucket="1m", group_by=["tenant"]
        )
        work = generate(policy, EVENTS, now_ms=int(time.time() * 1000), seed="duplicates")
        topic, bootstrap = worker_settings.topic("usage"), worker_settings.kafka_bootstrap
        # Same event ids, different bodies (10x the amount): the first delivery wins.
        altered = []
        for key, value in work.records[:200]:
            body = json.loads(value)
            if "usage" in body and body.get("kind") == "commit":
                body["usage"] = {k: v * 10 for k, v in body["usage"].items()}
                altered.append((key, json.dumps(body).encode()))
        workers.start()
        await apply_policies(policy)
        await produce(bootstrap, topic, work.records)
        plain = await _produce_plain_twice(bootstrap, topic, work.records)
        await produce(bootstrap, topic, altered)
        fault_record.fault(f"{len(work.records)} records sent by an idempotent producer")
        fault_record.fault(
            f"the same batch sent twice more by a non-idempotent producer ({plain} records)"
        )
        fault_record.fault(
            f"{len(altered)} records re-sent with the same event_id and 10x the usage"
        )
        fault_record.fault(f"{work.duplicates} in-stream duplicates inside the workload itself")
        total = len(work.records) + plain + len(altered)
        prefix = worker_settings.redis_prefix
        group = worker_settings.app_id
        on_topic = 0
        try:
            # Every copy (the last ones are the altered re-sends) read and acknowledged...
            ends = await wait_consumed(bootstrap, group, topic, timeout_s=240)
            on_topic = ends[topic]
            # ...then the windows; and again after a second full pass, so a copy applied
            # after its offset was committed cannot slip in behind a passing check.
            for attempt in ("first", "second"):
                await eventually(
                    lambda: compare(redis_sync, prefix, work.expected).exact,
                    timeout_s=60,
                    what=f"windows equal to the ledger ({attempt} check, all copies read)",
                )
                await wait_consumed(bootstrap, group, topic, timeout_s=60)
        finally:
            final = compare(redis_sync, prefix, work.expected)
            fault_record.add(
                events_checked=total,
                records_on_topic=on_topic,
                distinct_events=len(work.records) - work.duplicates,
                duplicate_deliveries=total - (len(work.records) - work.duplicates),
                units_expected=final.units_expected,
                units_held=final.units_held,
                units_lost=final.units_lost,
                units_double_counted=final.units_double_counted,
                cells_differing=final.cells_differing,
            )
        # Every copy sent reached the topic (acks=1 retries may add more, never fewer).
        assert on_topic >= total
        # What Redis holds (every window under the prefix) is the ledger's sum, on its keys.
        assert final.units_held == work.units()
        assert final.keys_missing == final.keys_unexpected == ()
        assert (final.units_lost, final.units_double_counted, final.cells_differing) == (0, 0, 0)

    async def test_repeated_admits_and_commits_through_admission_count_once(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens", limit=10**9, window="1h", bucket="1m", group_by=["tenant"]
        )
        workers.start()
        await apply_policies(policy)
        tenant = f"dup{uuid.uuid4().hex[:6]}"
        subject = {"tenant": tenant, "model": "m1"}
        committed = 0
        statuses: dict[str, int] = {}
        reservations = 30

        def note(resp: httpx.Response, what: str) -> None:
            label = f"{what} {resp.status_code}"
            statuses[label] = statuses.get(label, 0) + 1

        for i in range(reservations):
            body = {
                "request_id": f"{tenant}-req-{i}",
                "subject": subject,
                "estimate": {"input_tokens": 100},
            }
            answers = await asyncio.gather(
                *(admission_client.post("/v1/admit", json=body) for _ in range(3))
            )
            for a in answers:
                note(a, "admit")
            rids = {a.json()["reservation_id"] for a in answers}
            assert len(rids) == 1, answers
            rid = rids.pop()
            if i % 3 == 2:
                for _ in range(2):
                    note(
                        await admission_client.post("/v1/release", json={"reservation_id": rid}),
                        "release",
                    )
                continue
            used = 10 + i
            committed += used
            for _ in range(2):
                note(
                    await admission_client.post(
                        "/v1/commit",
                        json={"reservation_id": rid, "usage": {"input_tokens": used}},
                    ),
                    "commit",
                )
        fault_record.fault(
            f"{reservations} admits each sent 3 times concurrently with one request_id; "
            "each commit or release sent twice"
        )
        key = f"{policy.id}|tenant={tenant}"
        prefix = worker_settings.redis_prefix

        def counted() -> int:
            return sum(read_buckets(redis_sync, prefix, key).values())

        try:
            # Every published event (repeats included) read by the worker, then the windows.
            await wait_consumed(
                worker_settings.kafka_bootstrap,
                worker_settings.app_id,
                worker_settings.topic("usage"),
                timeout_s=120,
            )
            await eventually(
                lambda: counted() == committed and pending_sum(redis_sync, prefix, key) == 0,
                timeout_s=60,
                what="committed usage counted once, nothing pending",
            )
        finally:
            have = counted()
            fault_record.add(
                events_checked=sum(statuses.values()),
                http_answers=statuses,
                units_expected=committed,
                units_counted=have,
                units_lost=max(0, committed - have),
                units_double_counted=max(0, have - committed),
                pending_left=pending_sum(redis_sync, prefix, key),
            )
        # 30 request ids x 3 concurrent admits, each answered with the first allow (the
        # budget holds 3,000 of 10**9: nothing may refuse); a repeated commit or release
        # is accepted again (202: retries are safe) and counted once.
        assert statuses == {"admit 200": 90, "commit 202": 40, "release 202": 20}
        assert counted() == committed
        assert pending_sum(redis_sync, prefix, key) == 0
