"""``spendgate simulate`` on a real broker: a seeded history judged against a draft policy.

The expected refusals come from a brute-force model written here from the documented
counterfactual (``spendgate/simulate.py``'s docstring) and the reference window total of
``tests/schemas/reference.py``; it never imports the code it judges.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from spendgate.schemas.policies import Policy
from spendgate.simulate import simulate
from spendgate.streams.kafka_util import assign, partitions, stop
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import ensure_topics
from tests.fixtures.kafka_io import produce
from tests.fixtures.seeds import RUN_SEED
from tests.schemas import reference

pytestmark = pytest.mark.integration

WINDOW_MS, BUCKET_MS, LIMIT = 120_000, 10_000, 1_000
TENANTS = ("t1", "t2", "t3")


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


@dataclass
class History:
    """The generated records (in event-time order) and what the model expects."""

    usage: list[tuple[bytes, bytes]] = field(default_factory=list)
    refusals: list[tuple[bytes, bytes]] = field(default_factory=list)
    #: tenant -> instants (ms) of the requests the draft refuses.
    refused: dict[str, list[int]] = field(default_factory=dict)
    requests: int = 0
    repeated: int = 0


def generate(seed: str, base_ms: int) -> History:
    """Requests of three tenants over 10 minutes; the model judges each as it goes."""
    rng = random.Random(seed)
    h = History()
    # Everything that happens, as (ms, what, fields); unique instants keep the order plain.
    planned: list[tuple[int, str, dict[str, Any]]] = []
    used_ms: set[int] = set()

    def instant(ms: int) -> int:
        while ms in used_ms:
            ms += 1
        used_ms.add(ms)
        return ms

    refusal_ids: list[str] = []
    for n in range(240):
        tenant = rng.choice(TENANTS)
        at = instant(base_ms + rng.randrange(600_000))
        estimate = rng.randrange(20, 120)
        if rng.random() < 0.2:
            rid = f"q{n}"
            planned.append((at, "refusal", {"tenant": tenant, "estimate": estimate, "rid": rid}))
            refusal_ids.append(rid)
            continue
        settle = rng.random()
        planned.append((at, "reserve", {"tenant": tenant, "estimate": estimate, "rid": f"r{n}"}))
        later = instant(at + rng.randrange(100, 5_000))
        if settle < 0.7:
            actual = rng.randrange(0, estimate + 1)
            planned.append((later, "commit", {"tenant": tenant, "actual": actual, "rid": f"r{n}"}))
        elif settle < 0.9:
            planned.append((later, "release", {"tenant": tenant, "rid": f"r{n}"}))
    # Retries of refused requests: same request id, later instant (counted once).
    for rid in rng.sample(refusal_ids, min(8, len(refusal_ids))):
        first = next(p for p in planned if p[1] == "refusal" and p[2]["rid"] == rid)
        planned.append((instant(first[0] + 1_000), "refusal", dict(first[2])))
    # Commits without a reservation, charged as they happened.
    for n in range(30):
        at = instant(base_ms + rng.randrange(600_000))
        planned.append(
            (at, "direct", {"tenant": rng.choice(TENANTS), "actual": rng.randrange(1, 40), "n": n})
        )
    planned.sort(key=lambda p: p[0])

    charges: dict[str, list[tuple[int, int]]] = {t: [] for t in TENANTS}
    held: dict[str, tuple[int, int]] = {}  # admitted reservation -> (ms, estimate)
    refused_rids: set[str] = set()
    seen_refusals: set[str] = set()
    for at, what, f in planned:
        tenant = f["tenant"]
        subject = {"tenant": tenant, "model": "m1"}
        if what in ("reserve", "refusal"):
            if what == "refusal" and f["rid"] in seen_refusals:
                h.repeated += 1
            else:
                h.requests += 1
                used = reference.reference_total(
                    WINDOW_MS, BUCKET_MS, "include", charges[tenant], at
                )
                if used + f["estimate"] > LIMIT:
                    h.refused.setdefault(tenant, []).append(at)
                    refused_rids.add(f["rid"])
                else:
                    charges[tenant].append((at, f["estimate"]))
                    held[f["rid"]] = (at, f["estimate"])
            if what == "refusal":
                seen_refusals.add(f["rid"])
                body = {
                    "schema_version": 1,
                    "request_id": f["rid"],
                    "subject": subject,
                    "estimate": {"input_tokens": f["estimate"]},
                    "violated": ["live"],
                    "decision": "reject",
                    "at": iso(at),
                }
                h.refusals.append((tenant.encode(), json.dumps(body).encode()))
                continue
            body = {
                "event_id": f"e-{f['rid']}",
                "kind": "reserve",
                "subject": subject,
                "occurred_at": iso(at),
                "reservation_id": f["rid"],
                "usage": {"input_tokens": f["estimate"]},
                "expires_at": iso(at + 600_000),
            }
        elif what == "direct":
            charges[tenant].append((at, f["actual"]))
            body = {
                "event_id": f"d{f['n']}",
                "kind": "commit",
                "subject": subject,
                "occurred_at": iso(at),
                "usage": {"input_tokens": f["actual"]},
            }
        else:
            rid = f["rid"]
            if rid in held:
                r_ms, estimate = held.pop(rid)
                actual = f.get("actual", 0)
                charges[tenant].append((r_ms, actual - estimate))
            body = {
                "event_id": f"{what}-{rid}",
                "kind": what,
                "subject": subject,
                "occurred_at": iso(at),
                "reservation_id": rid,
            }
            if what == "commit":
                body["usage"] = {"input_tokens": f["actual"]}
        h.usage.append((tenant.encode(), json.dumps(body).encode()))
    return h


async def end_offsets(settings: WorkerSettings) -> dict[str, dict[int, int]]:
    """Every topic of this test's prefix -> partition -> end offset."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        names = sorted(t for t in await admin.list_topics() if t.startswith(settings.topic_prefix))
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await consumer.start()
    try:
        out: dict[str, dict[int, int]] = {}
        for name in names:
            tps = await partitions(consumer, name)
            await assign(consumer, tps)
            out[name] = {tp.partition: o for tp, o in (await consumer.end_offsets(tps)).items()}
        return out
    finally:
        await stop(consumer)


def draft() -> Policy:
    return Policy.model_validate(
        {
            "id": "draft-tenant",
            "unit": "input_tokens",
            "limit": LIMIT,
            "window": "2m",
            "bucket": "10s",
            "group_by": ["tenant"],
        }
    )


def generate_refusing(seed: str, base_ms: int, at_least: int) -> History:
    """The first history drawn from ``seed`` (then ``seed-1``, ``seed-2``...) whose draft
    refuses ``at_least`` requests: some seeds draw too little demand to refuse anything."""
    for attempt in range(50):
        h = generate(seed if attempt == 0 else f"{seed}-{attempt}", base_ms)
        if sum(map(len, h.refused.values())) >= at_least:
            return h
    raise AssertionError(f"no history from {seed} refuses {at_least} requests")


def redis_state(client: redis.Redis, prefix: str) -> dict[bytes, bytes | None]:
    """Every key of ``prefix`` with its value (``DUMP``: the value's bytes, whatever its
    type), so a changed value is seen and not only an added or removed key."""
    return {key: client.dump(key) for key in sorted(client.scan_iter(f"{prefix}*"))}


def seed_redis(client: redis.Redis, prefix: str) -> dict[bytes, bytes | None]:
    """Keys of every type under ``prefix``, among them the windows and the pending window
    of the draft's own keys (what a simulate that wrote would touch); their state."""
    from spendgate.schemas import window_codec
    from spendgate.schemas.redis_keys import pending_window_key, window_key

    for tenant in TENANTS:
        key = f"draft-tenant|tenant={tenant}"
        window = window_codec.encode({60_000: 7}, 60_000)
        client.set(window_key(prefix, key), window)
        client.set(pending_window_key(prefix, key), window)
    client.set(f"{prefix}sentinel", b"x")
    client.hset(f"{prefix}sentinel-hash", mapping={"a": "1"})
    client.zadd(f"{prefix}sentinel-zset", {"m": 1.0})
    client.sadd(f"{prefix}sentinel-set", "m")
    client.rpush(f"{prefix}sentinel-list", "m")
    return redis_state(client, prefix)


class TestSimulate:
    async def test_reports_exactly_the_model_s_refusals_and_touches_nothing(
        self, worker_settings: WorkerSettings, redis_sync: redis.Redis, tmp_path: Path
    ) -> None:
        await ensure_topics(worker_settings)
        base_ms = (int(datetime.now(UTC).timestamp() * 1000) - 3_600_000) // 1000 * 1000
        h = generate_refusing(f"{RUN_SEED}-simulate", base_ms, at_least=5)
        await produce(worker_settings.kafka_bootstrap, worker_settings.topic("usage"), h.usage)
        await produce(
            worker_settings.kafka_bootstrap, worker_settings.topic("refusals"), h.refusals
        )
        redis_before = seed_redis(redis_sync, worker_settings.redis_prefix)
        topics_before = await end_offsets(worker_settings)

        report = await simulate(worker_settings, [draft()])

        (pr,) = report.policies.values()
        assert report.requests == h.requests
        assert report.repeated_refusals == h.repeated
        assert pr.refused == sum(map(len, h.refused.values()))
        for tenant in TENANTS:
            key = pr.keys[f"draft-tenant|tenant={tenant}"]
            times = h.refused.get(tenant, [])
            assert key.refused == len(times), tenant
            if times:
                assert key.first_refusal == datetime.fromtimestamp(times[0] / 1000, UTC)
                assert key.last_refusal == datetime.fromtimestamp(times[-1] / 1000, UTC)
            else:
                assert key.first_refusal is None
        assert report.dropped_settlements > 0
        # --to: the history up to an instant, judged the same way (nothing later matters).
        until_ms = base_ms + 300_000
        early = await simulate(
            worker_settings, [draft()], until=datetime.fromtimestamp(until_ms / 1000, UTC)
        )
        (early_pr,) = early.policies.values()
        assert early_pr.refused == sum(t <= until_ms for ts in h.refused.values() for t in ts)
        assert redis_state(redis_sync, worker_settings.redis_prefix) == redis_before
        assert await end_offsets(worker_settings) == topics_before

        # The command: the same counts as JSON, and a chart.
        draft_file = tmp_path / "draft.json"
        draft_file.write_text(json.dumps([draft().model_dump(exclude_none=True)]))
        chart = tmp_path / "chart.png"
        env = {
            **os.environ,
            "SPENDGATE_KAFKA_BOOTSTRAP": worker_settings.kafka_bootstrap,
            "SPENDGATE_TOPIC_PREFIX": worker_settings.topic_prefix,
            "SPENDGATE_REDIS_URL": worker_settings.redis_url,
            "SPENDGATE_REDIS_PREFIX": worker_settings.redis_prefix,
        }
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "spendgate", "simulate", "--policies", str(draft_file),
             "--json", "--chart", str(chart)],
            env=env, capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()
        body = json.loads(done.stdout)
        assert body["policies"][0]["refused"] == pr.refused
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        table = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "spendgate", "simulate", "--policies", str(draft_file),
             "--compare"],
            env={**env, "COLUMNS": "250"}, capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert table.returncode == 0, table.stderr.decode()
        text = table.stdout.decode()
        # No policy is in force on this test's topics: the draft stands beside "(none)".
        assert "in force" in text and "(none)" in text
        assert f"draft-tenant|tenant={TENANTS[0]}" in text or "draft-tenant|tenant=" in text
        assert f"{report.requests} requests judged" in text
        assert await end_offsets(worker_settings) == topics_before
