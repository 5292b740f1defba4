"""The worker rides through store faults (issue 40): every Redis error is a retry, and a
mark never vouches for a window Redis did not take.

A real ``spendgate worker`` on a private ``redis-server`` that is stopped for a few seconds
and started again empty while usage keeps arriving: the worker process lives and its log
shows no crash, the marks vouch for every partition again within one staleness bound of
Redis coming back, and the windows hold exactly what was produced (nothing lost, nothing
counted twice), on a key local to its tenant and on one spanning tenants.

The worker runs with a stall bound and an exit bound (issue 52) both shorter than the
outage: every store error is an answer and its backoff no stall, so ``/healthz`` answers
200 all through it and the worker does not exit (a Redis outage must not restart every
worker at once; ``/readyz`` answers 503 meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from spendgate.schemas.redis_keys import marks_key, window_key, window_version_key
from spendgate.schemas.shards import usage_mark
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.effects import KeyWrite
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.scripts.mark import MarkWrite
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import OwnRedis, free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, metric, produce, window_sum
from tests.fixtures.pipeline import Workers, all_marked, apply_and_wait

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TENANTS = [f"t{i}" for i in range(6)]
#: The staleness bound admission decides with (the default).
STALENESS_S = 30.0
#: How long Redis stays down while usage keeps arriving.
OUTAGE_S = 6.0
#: The worker's stall and exit bounds, both shorter than the outage.
BOUNDS = {
    "SPENDGATE_WORKER_KAFKA_WAIT_S": "2",
    "SPENDGATE_WORKER_STALL_S": "2.5",
    "SPENDGATE_WORKER_EXIT_S": "4",
}


def _commit(tenant: str, amount: int) -> bytes:
    return json.dumps(
        {
            "event_id": uuid.uuid4().hex,
            "kind": "commit",
            "subject": {"tenant": tenant, "model": "m"},
            "occurred_at": datetime.now(UTC).isoformat(),
            "usage": {"input_tokens": amount},
        }
    ).encode()


@pytest.fixture
def own_settings(worker_settings: WorkerSettings, own_redis: OwnRedis) -> WorkerSettings:
    return worker_settings.model_copy(update={"redis_url": own_redis.url})


@pytest.fixture
def own_workers(
    own_settings: WorkerSettings, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Workers]:
    """Worker processes on this test's topics and its private Redis."""
    factory = Workers(own_settings, tmp_path)
    request.node.spendgate_logs = lambda: sorted(tmp_path.glob("worker-*.log"))
    yield factory
    factory.stop_all()


def _safe(check: object) -> bool:
    """``check()``, False while Redis does not answer."""
    try:
        return bool(check())  # type: ignore[operator]
    except redis.RedisError:
        return False


class TestRedisOutage:
    async def test_worker_lives_through_a_redis_restart_and_marks_resume(
        self,
        own_redis: OwnRedis,
        own_settings: WorkerSettings,
        own_workers: Workers,
        policy_factory: PolicyFactory,
        tmp_path: Path,
    ) -> None:
        settings, workers = own_settings, own_workers
        prefix = settings.redis_prefix
        client = redis.Redis.from_url(own_redis.url, socket_timeout=2)
        port = free_port()
        proc = workers.start(metrics_port=port, env=BOUNDS)
        sent: Counter[str] = Counter()
        topic = settings.topic("usage")

        async def send(n: int) -> None:
            batch = []
            for i in range(n):
                tenant = TENANTS[i % len(TENANTS)]
                amount = 1 + i % 7
                sent[tenant] += amount
                batch.append((tenant.encode(), _commit(tenant, amount)))
            await produce(settings.kafka_bootstrap, topic, batch)

        try:
            per_tenant = policy_factory(
                id="per-tenant", unit="input_tokens", limit=10**9, window="1h", bucket="1m"
            )
            overall = policy_factory(
                id="overall",
                unit="input_tokens",
                limit=10**9,
                window="1h",
                bucket="1m",
                group_by=[],
            )
            await apply_and_wait(settings, client, per_tenant, overall, timeout_s=120)
            await send(60)
            await eventually(
                lambda: window_sum(client, prefix, "overall") == sum(sent.values()),
                timeout_s=60,
                what="the first commits counted",
            )

            # The outage, usage arriving all along (and the drift check due on live keys).
            own_redis.stop()
            stopped = time.monotonic()
            probes: Counter[int] = Counter()
            async with httpx.AsyncClient(timeout=2) as http:
                while time.monotonic() - stopped < OUTAGE_S:
                    await send(12)
                    for _ in range(2):
                        try:
                            answer = await http.get(f"http://127.0.0.1:{port}/healthz")
                            probes[answer.status_code] += 1
                        except httpx.HTTPError:
                            probes[0] += 1  # no answer: the worker is gone
                        await asyncio.sleep(0.25)
            assert proc.poll() is None, "the worker exited during the outage"
            assert set(probes) == {200}, f"/healthz during the outage: {dict(probes)}"
            own_redis.start()  # empty: no persistence
            back = time.monotonic()

            async def more() -> None:
                while time.monotonic() - back < 2.0:
                    await send(12)
                    await asyncio.sleep(0.5)

            load = asyncio.create_task(more())
            await eventually(
                lambda: _safe(lambda: all_marked(client, prefix, int(STALENESS_S * 1000))),
                timeout_s=STALENESS_S,
                what="every partition vouched for again within one staleness bound",
            )
            resumed_s = time.monotonic() - back
            print(f"marks resumed {resumed_s:.1f} s after Redis came back")
            await load

            total = sum(sent.values())
            await eventually(
                lambda: _safe(lambda: window_sum(client, prefix, "overall") == total),
                timeout_s=60,
                what="every commit counted once on the key spanning tenants",
            )
            for tenant in TENANTS:
                key = f"per-tenant|tenant={tenant}"
                assert window_sum(client, prefix, key) == sent[tenant], key
            assert window_sum(client, prefix, "overall") == total
            assert proc.poll() is None, "the worker exited"
            assert metric(port, "spendgate_worker_store_errors_total") > 0
        finally:
            workers.stop_all()
            client.close()
        log = (tmp_path / "worker-w1.log").read_text(errors="replace")
        assert "Crashed" not in log, log[-4000:]
        assert "Traceback" not in log, log[-4000:]


class TestMarkFollowsItsWindows:
    async def test_a_failed_absorb_leaves_the_mark_where_it_was(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        """An ABSORB that raises (a key of the wrong type in Redis) must stop the batch's
        MARK: the mark would vouch for a window Redis does not hold."""
        client, prefix = redis_client, key_prefix
        m = RedisMaterializer(client, prefix)
        presence = f"{prefix}worker:test"
        field = usage_mark(0)
        spec = WindowSpec(3_600_000, 60_000)

        def write(key: str, amount: int, offset: int) -> KeyWrite:
            state = KeyState(buckets={0: amount}, bucket_ms=60_000, window_ms=3_600_000)
            state.offsets = {0: offset}
            return KeyWrite(key, state, spec, True, True)

        token = (await m.claim([field], presence))[field].token
        reply = await m.write_batch(
            [write("p|t=a", 5, 1)], [MarkWrite(field, token, 1_000)], presence
        )
        assert reply is not None and reply.written == 1
        # A key of the wrong type where ABSORB reads the window's version: the script errors.
        await client.rpush(window_version_key(prefix, "p|t=b"), "not a version")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await m.write_batch(
                [write("p|t=a", 6, 2), write("p|t=b", 7, 3)],
                [MarkWrite(field, token, 2_000, position=4)],
                presence,
            )
        assert await client.hget(marks_key(prefix), field) == b"1000"
        assert not await client.exists(window_key(prefix, "p|t=b"))
