"""Refused admissions reach ``{prefix}refusals``; the worker does not account them."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections import Counter
from datetime import UTC, datetime

import httpx
import pytest
import redis
from aiokafka import AIOKafkaProducer, ConsumerRecord

from spendgate.admission.refusals import KafkaRefusals
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.policies import Policy
from spendgate.schemas.refusals import Refusal, RefusalGap
from spendgate.simulate import simulate
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import ensure_topics
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import (
    buckets,
    eventually,
    pending_sum,
    read_all,
    read_records,
    window_sum,
)
from tests.fixtures.pipeline import ApplyPolicies

pytestmark = pytest.mark.integration

#: More than any refusal of these tests takes in a record batch (JSON and framing).
RECORD_MAX = 600


class SpiedRefusals(KafkaRefusals):
    """The product's sink, its producer's sends recorded as they are made: every
    ``send`` (one record each), every ``send_batch`` (partition, records in the batch),
    and every pass of the background task over the queue; ``full`` says whether a sent
    batch had no room left for one more refusal."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sends: list[str] = []
        self.batches: list[tuple[int, int]] = []
        self.full: list[bool] = []
        self.passes = 0

    async def _start(self) -> AIOKafkaProducer:
        producer = await super()._start()
        send, send_batch = producer.send, producer.send_batch
        room = int(getattr(producer, "_max_batch_size", 16_384))

        async def spied_send(topic: str, *args: object, **kwargs: object) -> object:
            self.sends.append(topic)
            return await send(topic, *args, **kwargs)  # type: ignore[arg-type]

        async def spied_send_batch(batch: object, topic: str, *, partition: int) -> object:
            self.batches.append((partition, batch.record_count()))  # type: ignore[attr-defined]
            self.full.append(batch.size() + RECORD_MAX > room)  # type: ignore[attr-defined]
            return await send_batch(batch, topic, partition=partition)

        producer.send = spied_send  # type: ignore[method-assign]
        producer.send_batch = spied_send_batch  # type: ignore[method-assign]
        return producer

    async def _send_queued(self, *args: object) -> None:
        self.passes += 1
        await super()._send_queued(*args)  # type: ignore[arg-type]

    def assert_batched(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        """No refusal sent on its own; per partition at most one batch a pass that was not
        full (a batch is split only when full); the batches' record counts per partition
        are what the topic holds."""
        assert self.sends == [], f"{len(self.sends)} refusals sent one by one"
        on_topic = Counter(r.partition for r in records)
        batched: Counter[int] = Counter()
        partial: Counter[int] = Counter()
        for (partition, count), full in zip(self.batches, self.full, strict=True):
            batched[partition] += count
            partial[partition] += not full
        assert batched == on_topic, (batched, on_topic)
        assert all(n <= self.passes for n in partial.values()), (partial, self.passes)
        full = sum(self.full)
        assert len(self.batches) <= len(on_topic) * self.passes + full, self.batches


class TestRefusalsTopic:
    async def test_a_refused_admit_is_published_and_changes_no_window(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(limit=100, unit="input_tokens", window="1h", bucket="1m")
        await apply_policies(policy)
        key = f"{policy.id}|tenant=acme"
        prefix = worker_settings.redis_prefix
        admitted = await admission_client.post(
            "/v1/admit",
            json={
                "request_id": "ok-1",
                "subject": {"tenant": "acme", "model": "m1"},
                "estimate": {"input_tokens": 60},
            },
        )
        assert admitted.status_code == 200, admitted.text
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 60, what="reserve")
        before = buckets(redis_sync, prefix, key)

        rid = f"no-{uuid.uuid4().hex[:8]}"
        body = {
            "request_id": rid,
            "subject": {"tenant": "acme", "model": "m1", "labels": {"app": "x"}},
            "estimate": {"input_tokens": 50, "output_tokens": 5},
        }
        refused = await admission_client.post("/v1/admit", json=body)
        assert refused.status_code == 429, refused.text

        found: list[Refusal] = []
        for _ in range(100):  # published without waiting: give the background send time
            values = await read_all(
                worker_settings.kafka_bootstrap, worker_settings.topic("refusals")
            )
            found = [Refusal.model_validate_json(v) for v in values]
            if found:
                break
            await asyncio.sleep(0.1)
        (refusal,) = found
        assert refusal.request_id == rid
        assert refusal.subject.model_dump(exclude_none=True) == {
            "tenant": "acme",
            "model": "m1",
            "labels": {"app": "x"},
        }
        assert refusal.estimate.input_tokens == 50 and refusal.estimate.output_tokens == 5
        assert refusal.violated == [policy.id]
        assert refusal.decision == "reject"
        assert abs(refusal.at.timestamp() - time.time()) < 60

        # An admit after the refusal proves the worker got past it: its reserve shows up,
        # and the refusal added nothing to the window or the pending reservations.
        later = await admission_client.post(
            "/v1/admit",
            json={
                "request_id": "ok-2",
                "subject": {"tenant": "acme", "model": "m1"},
                "estimate": {"input_tokens": 40},
            },
        )
        assert later.status_code == 200, later.text
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 100, what="second")
        assert sum(before.values()) == 60
        await asyncio.sleep(1.0)  # had the refusal been charged, 50 more would show by now
        assert window_sum(redis_sync, prefix, key) == 100
        assert pending_sum(redis_sync, prefix, key) == 0


class TestRefusalBatches:
    async def test_every_refusal_is_sent_once_keyed_by_its_subject(
        self, worker_settings: WorkerSettings
    ) -> None:
        """Refusals go out in record batches per partition (more than one when a batch is
        full), 1,000 a pass: each arrives exactly once, and a subject's refusals share one
        partition."""
        await ensure_topics(worker_settings)
        topic = worker_settings.topic("refusals")
        tenants = [f"t{n}" for n in range(7)]
        at = datetime.now(UTC)
        sent = {
            f"q{n}": tenants[n % len(tenants)] for n in range(2_500)
        }  # ~60 records fill a 16 KiB batch: dozens of full batches
        async with SpiedRefusals(worker_settings.kafka(), topic, buffer=len(sent)) as sink:
            for rid, tenant in sent.items():
                assert sink.offer(
                    Refusal(
                        request_id=rid,
                        subject=Subject(tenant=tenant),
                        estimate=Usage(input_tokens=5),
                        violated=["p"],
                        at=at,
                    )
                )
            assert await sink.flush(20.0)
        records = await read_records(worker_settings.kafka_bootstrap, topic)
        got = [Refusal.model_validate_json(r.value or b"") for r in records]
        assert sorted(r.request_id for r in got) == sorted(sent)
        assert all(sent[r.request_id] == r.subject.tenant for r in got)
        partitions_of: dict[str, set[int]] = {}
        for record, refusal in zip(records, got, strict=True):
            partitions_of.setdefault(refusal.subject.tenant, set()).add(record.partition)
            assert record.key == refusal.subject.tenant.encode()
        assert all(len(p) == 1 for p in partitions_of.values()), partitions_of
        # Batches, never one send per refusal; split only when full: dozens of records each.
        sink.assert_batched(records)
        assert sink.passes >= 3  # 1,000 a pass
        assert len(sink.batches) < len(sent) // 10

    async def test_refusals_go_out_as_one_record_batch_per_partition_not_a_send_each(
        self, worker_settings: WorkerSettings
    ) -> None:
        """The batching itself: 200 refusals across 7 tenants, none sent on its own; per
        partition at most one batch a pass of the background task that is not full (a
        batch is split only when full), and the batches' record counts are what the topic
        holds, partition by partition."""
        await ensure_topics(worker_settings)
        topic = worker_settings.topic("refusals")
        tenants = [f"t{n}" for n in range(7)]
        at = datetime.now(UTC)
        n = 200
        async with SpiedRefusals(worker_settings.kafka(), topic, buffer=n) as sink:
            for i in range(n):
                assert sink.offer(
                    Refusal(
                        request_id=f"b{i}",
                        subject=Subject(tenant=tenants[i % len(tenants)]),
                        estimate=Usage(input_tokens=5),
                        violated=["p"],
                        at=at,
                    )
                )
            assert await sink.flush(20.0)
        records = await read_records(worker_settings.kafka_bootstrap, topic)
        assert len(records) == n
        assert sorted(r.key or b"" for r in records) == sorted(
            t.encode() for i in range(n) for t in [tenants[i % len(tenants)]]
        )
        assert 1 <= sink.passes <= 2, sink.passes  # offered at once: one pass, or two
        sink.assert_batched(records)
        assert sum(count for _, count in sink.batches) == n


class TestRefusalGaps:
    async def test_dropped_refusals_are_said_on_the_topic_and_simulate_reports_them(
        self, worker_settings: WorkerSettings
    ) -> None:
        await ensure_topics(worker_settings)
        topic = worker_settings.topic("refusals")
        sink = KafkaRefusals(worker_settings.kafka(), topic, buffer=1)
        at = datetime.now(UTC)
        offered = [
            sink.offer(
                Refusal(
                    request_id=f"q{n}",
                    subject=Subject(tenant="acme"),
                    estimate=Usage(input_tokens=5),
                    violated=["p"],
                    at=at,
                )
            )
            for n in range(3)
        ]
        assert offered == [True, False, False]
        async with sink:
            assert await sink.flush(10.0)
        values = await read_all(worker_settings.kafka_bootstrap, topic)
        gaps = [RefusalGap.model_validate_json(v) for v in values if b'"gap"' in v]
        kept = [Refusal.model_validate_json(v) for v in values if b'"gap"' not in v]
        assert [g.dropped for g in gaps] == [2]
        assert [r.request_id for r in kept] == ["q0"]

        report = await simulate(
            worker_settings,
            [Policy.model_validate({"id": "p", "unit": "input_tokens", "limit": 9})],
        )
        assert report.dropped_at_publish == 2
        assert report.refusal_records == 1
