"""Topic helpers for the processor and replay benchmarks: settings, workload, raw consume."""

from __future__ import annotations

import json
import random
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import _common as c

POLICY = {
    "id": "pb",
    "match": {},
    "group_by": ["tenant"],
    "unit": "total_tokens",
    "limit": 10**12,
    "window": "1h",
    "bucket": "1m",
}


def settings(rid: str, data_dir: Path, metrics_port: int = 0, partitions: int = 4) -> Any:
    """Worker settings on this run's own topics, Redis keys, consumer group and tables."""
    from spendgate.streams.settings import WorkerSettings

    return WorkerSettings(
        kafka_bootstrap=c.KAFKA,
        redis_url=c.REDIS,
        topic_prefix=f"{rid}.",
        redis_prefix=f"{rid}:",
        app_id=rid,
        data_dir=data_dir,
        metrics_port=metrics_port,
        partitions=partitions,
    )


def worker_env(s: Any) -> dict[str, str]:
    """The environment of a ``spendgate worker`` child with settings ``s``."""
    return {
        "SPENDGATE_KAFKA_BOOTSTRAP": s.kafka_bootstrap,
        "SPENDGATE_REDIS_URL": s.redis_url,
        "SPENDGATE_TOPIC_PREFIX": s.topic_prefix,
        "SPENDGATE_REDIS_PREFIX": s.redis_prefix,
        "SPENDGATE_APP_ID": s.app_id,
        "SPENDGATE_DATA_DIR": str(s.data_dir),
        "SPENDGATE_METRICS_PORT": str(s.metrics_port),
        "SPENDGATE_PARTITIONS": str(s.partitions),
    }


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def event(tenant: str, occurred_ms: int, amount: int, *, reserve: bool = False) -> bytes:
    """One direct ``commit`` usage event for ``tenant`` (a ``reserve`` when asked: what
    ``simulate`` judges as a request)."""
    body: dict[str, Any] = {
        "schema_version": 1,
        "event_id": uuid.uuid4().hex,
        "kind": "commit",
        "subject": {"tenant": tenant, "model": "m"},
        "occurred_at": iso(occurred_ms),
        "usage": {"input_tokens": amount, "output_tokens": amount // 2},
    }
    if reserve:
        body |= {
            "kind": "reserve",
            "reservation_id": body["event_id"],
            "expires_at": iso(occurred_ms + 900_000),
        }
    return json.dumps(body, separators=(",", ":")).encode()


async def setup_topics(s: Any) -> None:
    """Create the run's topics and publish the benchmark policy."""
    from spendgate.schemas.policies import Policy
    from spendgate.streams.policy_admin import publish_policies
    from spendgate.streams.topics import ensure_topics

    await ensure_topics(s)
    await publish_policies(s, [Policy.model_validate(POLICY)])


async def fill(s: Any, events: int, keys: int, seed: int = 1, *, reserves: bool = False) -> float:
    """Produce ``events`` commits (``reserves``: reserves) spread over ``keys`` tenants
    (occurred in the last 30 min); return the seconds it took."""
    from aiokafka import AIOKafkaProducer

    rng = random.Random(seed)
    now = int(time.time() * 1000)
    start = now - 30 * 60_000
    t0 = time.perf_counter()
    async with AIOKafkaProducer(
        bootstrap_servers=s.kafka_bootstrap,
        linger_ms=20,
        max_batch_size=512 * 1024,
        enable_idempotence=True,
    ) as producer:
        futures = []
        for i in range(events):
            tenant = f"t{i % keys}" if i < keys else f"t{rng.randrange(keys)}"
            futures.append(
                await producer.send(
                    s.topic("usage"),
                    event(
                        tenant,
                        start + (30 * 60_000) * i // events,
                        rng.randint(10, 2000),
                        reserve=reserves,
                    ),
                    key=tenant.encode(),
                )
            )
            if len(futures) >= 20_000:
                for fut in futures:
                    await fut
                futures = []
        await producer.flush()
        for fut in futures:
            await fut
    return time.perf_counter() - t0


async def raw_consume(s: Any, parse: bool = False) -> tuple[int, float]:
    """Read the whole usage topic with a plain aiokafka consumer (as replay configures it);
    return (records, seconds). ``parse``: also ``json.loads`` every value."""
    from aiokafka import AIOKafkaConsumer

    from spendgate.streams.kafka_util import assign, partitions, stop

    consumer = AIOKafkaConsumer(
        bootstrap_servers=s.kafka_bootstrap, enable_auto_commit=False, max_poll_records=2000
    )
    await consumer.start()
    try:
        t0 = time.perf_counter()
        tps = await partitions(consumer, s.topic("usage"))
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, 0)
        remaining = {tp for tp in tps if end[tp] > 0}
        n = 0
        deadline = time.monotonic() + 600
        while remaining and time.monotonic() < deadline:
            batch = await consumer.getmany(*remaining, timeout_ms=1000)
            for tp, messages in batch.items():
                for m in messages:
                    if parse:
                        json.loads(m.value or b"{}")
                n += len(messages)
                if messages and messages[-1].offset + 1 >= end[tp]:
                    remaining.discard(tp)
        return n, time.perf_counter() - t0
    finally:
        await stop(consumer)
