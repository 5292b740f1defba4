"""The worker's applied marks on a real broker and Redis (``schemas.shards``, ``streams.marks``).

Admission finds the partitions a key depends on by the same hash as the producers: here
the records really on the topics are checked against it, and the marks against the
windows they vouch for.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from datetime import UTC, datetime

import pytest
import redis
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer

from spendgate.schemas.redis_keys import (
    mark_owners_key,
    mark_progress_key,
    marks_key,
    topology_key,
    window_key,
)
from spendgate.schemas.shards import Topology, partition_for
from spendgate.streams.kafka_util import assign, partitions, stop
from spendgate.streams.marks import Claim
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.scripts.mark import MarkWrite
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, produce, window_sum
from tests.fixtures.pipeline import ApplyPolicies, all_marked

pytestmark = pytest.mark.integration

TENANTS = [f"t{i}" for i in range(12)]
#: Every key matching ARGV[1] deleted in one script (atomic: no command runs between the
#: SCAN that finds them and the DEL); replies with the keys deleted.
_FLUSH = """
local gone, cursor = {}, '0'
repeat
  local reply = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = reply[1]
  for _, k in ipairs(reply[2]) do gone[#gone + 1] = k end
until cursor == '0'
for i = 1, #gone, 1000 do redis.call('DEL', unpack(gone, i, math.min(i + 999, #gone))) end
return gone
"""


async def _placed(bootstrap: str, topic: str) -> list[tuple[int, bytes]]:
    """(partition, key) of every record in ``topic``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = await partitions(consumer, topic)
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[tuple[int, bytes]] = []
        while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
            for tp, messages in (await consumer.getmany(*tps, timeout_ms=500)).items():
                out += [(tp.partition, m.key or b"") for m in messages]
        return out
    finally:
        await stop(consumer)


def _commit(tenant: str) -> bytes:
    return json.dumps(
        {
            "event_id": uuid.uuid4().hex,
            "kind": "commit",
            "subject": {"tenant": tenant, "model": "m"},
            "occurred_at": datetime.now(UTC).isoformat(),
            "usage": {"input_tokens": 1},
        }
    ).encode()


class TestMarks:
    async def test_records_land_where_admission_looks_for_their_marks(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        per_tenant = policy_factory(id="per-tenant", unit="input_tokens", limit=10**6)
        overall = policy_factory(id="overall", unit="input_tokens", limit=10**6, group_by=[])
        await apply_policies(per_tenant, overall)
        bootstrap = worker_settings.kafka_bootstrap
        await produce(
            bootstrap,
            worker_settings.topic("usage"),
            [(t.encode(), _commit(t)) for t in TENANTS],
        )
        prefix = worker_settings.redis_prefix
        await eventually(
            lambda: window_sum(redis_sync, prefix, "overall") == len(TENANTS),
            what="every commit counted",
        )
        raw = redis_sync.get(topology_key(prefix))
        assert raw is not None
        topo = Topology.decode(raw)
        assert topo == Topology(worker_settings.partitions, worker_settings.partitions)
        usage = await _placed(bootstrap, worker_settings.topic("usage"))
        keyed = await _placed(bootstrap, worker_settings.keyed_topic)
        assert len(usage) == len(TENANTS)
        assert all(p == partition_for(k, topo.usage) for p, k in usage)
        assert len({p for p, _ in usage}) > 1  # the check spans several partitions
        # Only the key spanning tenants crosses the keyed topic (tenant keys stay local).
        assert keyed and {k for _, k in keyed} == {b"overall"}
        assert all(p == partition_for(k, topo.keyed) for p, k in keyed)

    async def test_caught_up_marks_follow_the_redis_clock_and_return_after_a_flush(
        self,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
    ) -> None:
        policy = policy_factory(id="marked", unit="input_tokens", limit=10**6)
        await apply_policies(policy)
        bootstrap, prefix = worker_settings.kafka_bootstrap, worker_settings.redis_prefix
        await produce(bootstrap, worker_settings.topic("usage"), [(b"acme", _commit("acme"))])
        key = "marked|tenant=acme"
        await eventually(lambda: window_sum(redis_sync, prefix, key) == 1, what="counted")

        def marks_fresh() -> bool:
            seconds, micros = redis_sync.time()
            now = seconds * 1000 + micros // 1000
            values = redis_sync.hvals(marks_key(prefix))
            return bool(values) and all(now - int(v) < 2_000 for v in values)

        # Idle and caught up: every mark is the present, refreshed every 0.5 s.
        await eventually(marks_fresh, what="marks at the present")
        # A flush of this test's keys, at one instant: one script collects and deletes
        # them all, so the worker (writing marks every 0.5 s) never sees a half-flushed
        # Redis (marks gone but its presence left, or the reverse).
        gone = {k.decode() for k in redis_sync.eval(_FLUSH, 0, f"{prefix}*")}
        assert {window_key(prefix, key), marks_key(prefix)} <= gone, gone
        assert any(k.startswith(f"{prefix}worker:") for k in gone), gone  # its presence
        flushed = time.monotonic()
        # The marks come back only with the window they vouch for.
        while not all_marked(redis_sync, prefix):
            assert time.monotonic() - flushed < 60, "marks did not come back"
            assert (
                redis_sync.hlen(marks_key(prefix)) == 0 or window_sum(redis_sync, prefix, key) == 1
            )
            await asyncio.sleep(0.05)
        assert window_sum(redis_sync, prefix, key) == 1


class TestFencing:
    """The claim and mark scripts on a real Redis (``streams/scripts`` CLAIM / MARK)."""

    async def test_a_lower_token_or_a_lower_watermark_with_the_same_token_is_refused(
        self, redis_client: aioredis.Redis, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        m = RedisMaterializer(redis_client, key_prefix)
        old_owner, new_owner = f"{key_prefix}worker:a", f"{key_prefix}worker:b"
        (first,) = (await m.claim(["usage:0"], old_owner)).values()
        assert first == Claim(1, None)
        assert (await m.write_marks([MarkWrite("usage:0", 1, 1_000)], old_owner)).written == 1
        # The partition moves: the new owner's token is higher, and it sees the mark.
        (second,) = (await m.claim(["usage:0"], new_owner)).values()
        assert second == Claim(2, 1_000)
        # The old owner, resumed, writes a later watermark: refused, the mark stays.
        reply = await m.write_marks([MarkWrite("usage:0", 1, 5_000)], old_owner)
        assert (reply.present, reply.written, reply.fenced) == (True, 0, 1)
        assert redis_sync.hget(marks_key(key_prefix), "usage:0") == b"1000"
        # Same token: a lower or equal watermark changes nothing, a higher one is written.
        for w, written in ((900, 0), (1_000, 0), (2_000, 1)):
            reply = await m.write_marks([MarkWrite("usage:0", 2, w)], new_owner)
            assert (reply.written, reply.fenced) == (written, 0), w
        assert redis_sync.hget(marks_key(key_prefix), "usage:0") == b"2000"
        assert redis_sync.hget(mark_owners_key(key_prefix), "usage:0") == b"2"

    async def test_progress_is_written_with_the_redis_clock_and_only_by_the_owner(
        self, redis_client: aioredis.Redis, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        m = RedisMaterializer(redis_client, key_prefix)
        me = f"{key_prefix}worker:a"
        await m.claim(["keyed:1"], me)
        await m.write_marks([MarkWrite("keyed:1", 1, None, behind=7)], me)
        behind, at = redis_sync.hget(mark_progress_key(key_prefix), "keyed:1").split(b":")
        seconds, micros = redis_sync.time()
        assert int(behind) == 7
        assert 0 <= seconds * 1000 + micros // 1000 - int(at) < 5_000
        assert redis_sync.hget(marks_key(key_prefix), "keyed:1") is None  # no watermark given
        await m.claim(["keyed:1"], f"{key_prefix}worker:b")
        reply = await m.write_marks([MarkWrite("keyed:1", 1, None, behind=99)], me)
        assert reply.fenced == 1
        assert redis_sync.hget(mark_progress_key(key_prefix), "keyed:1").startswith(b"7:")

    async def test_the_position_is_only_raised_and_handed_to_the_next_owner(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        m = RedisMaterializer(redis_client, key_prefix)
        a, b = f"{key_prefix}worker:a", f"{key_prefix}worker:b"
        await m.claim(["usage:0"], a)
        await m.write_marks([MarkWrite("usage:0", 1, 1_000, position=40)], a)
        await m.write_marks([MarkWrite("usage:0", 1, 1_001, position=30)], a)
        assert (await m.claim(["usage:0"], b))["usage:0"] == Claim(2, 1_001, 40)
        # The old owner, fenced, moves no position either.
        await m.write_marks([MarkWrite("usage:0", 1, None, position=99)], a)
        assert (await m.claim(["usage:0"], b))["usage:0"] == Claim(3, 1_001, 40)

    async def test_nothing_is_written_once_the_presence_mark_is_gone(
        self, redis_client: aioredis.Redis, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        m = RedisMaterializer(redis_client, key_prefix)
        me = f"{key_prefix}worker:a"
        await m.claim(["usage:0"], me)
        redis_sync.delete(me)  # Redis lost its data (as a flush would)
        reply = await m.write_marks([MarkWrite("usage:0", 1, 1_000)], me)
        assert (reply.present, reply.written) == (False, 0)
        assert redis_sync.hget(marks_key(key_prefix), "usage:0") is None

    async def test_the_sample_reads_the_clock_and_every_usage_mark_at_once(
        self, redis_client: aioredis.Redis, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        m = RedisMaterializer(redis_client, key_prefix)
        redis_sync.hset(marks_key(key_prefix), mapping={"usage:0": 10, "usage:2": 30})
        now, marks = await m.sample(["usage:0", "usage:1", "usage:2"])
        seconds, micros = redis_sync.time()
        assert marks == [10, None, 30]
        assert 0 <= seconds * 1000 + micros // 1000 - now < 5_000
