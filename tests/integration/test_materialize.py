"""What the worker keeps in Redis: absorbing reservations without a gap, memory per key."""

from __future__ import annotations

import asyncio
import subprocess
import uuid

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from spendgate.schemas import window_codec
from spendgate.schemas.redis_keys import (
    pending_queue_key,
    pending_reservations_key,
    pending_total_key,
    pending_window_key,
    utilization_key,
    window_key,
    window_version_key,
)
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.fold import KeyWrite
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import MakeAdmission
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.monitor import Call, monitored
from tests.fixtures.pipeline import ApplyPolicies

pytestmark = pytest.mark.integration


def _held(client: redis.Redis, prefix: str, key: str) -> tuple[int, int]:
    """Window sum and pending sum of ``key``, read in one transaction."""
    with client.pipeline(transaction=True) as pipe:
        pipe.get(window_key(prefix, key))
        pipe.hgetall(pending_window_key(prefix, key))
        pipe.hgetall(pending_total_key(prefix, key))
        raw, v1, v2 = pipe.execute()
    used = sum(window_codec.decode(raw).buckets.values()) if raw else 0
    # Bucket fields only: the version-2 hash also holds its sum and reservations' entries.
    return used, sum(int(v) for f, v in (*v1.items(), *v2.items()) if f.isdigit())


#: Commands that only read; any other command on a window or pending key writes it.
_READS = {b"GET", b"MGET", b"HGET", b"HMGET", b"HGETALL", b"HVALS", b"HLEN", b"EXISTS"}
_READS |= {b"PTTL", b"TTL", b"TYPE", b"STRLEN", b"HKEYS", b"HEXISTS", b"SCAN"}
_READS |= {b"GETRANGE", b"LRANGE", b"LINDEX", b"LLEN"}
#: The version-2 pending window's queue: bookkeeping, no amount.
_QUEUE_WRITES = {b"RPUSH", b"LPOP", b"LINSERT", b"DEL"}


def _steps(calls: list[Call], prefix: str, key: str) -> list[tuple[int, int, int, int]]:
    """Per command that changed ``key``'s window or pending entries, as Redis ran them
    (``MONITOR``): (window change, pending change, reservations added to the pending
    entries, reservations taken out). Fails if any such change was made outside a script
    (a step of its own)."""
    w, pw, pr, pv, pq = (
        window_key(prefix, key).encode(),
        pending_window_key(prefix, key).encode(),
        pending_reservations_key(prefix, key).encode(),
        pending_total_key(prefix, key).encode(),
        pending_queue_key(prefix, key).encode(),
    )
    ours = {w, pw, pr, pv, pq}
    window_total, pending = 0, {}  # the window's sum; the pending window's fields
    steps = []
    for call in calls:
        if call.name not in _READS and any(a in ours for a in call.args[1:2]):
            raise AssertionError(f"written outside a script: {call.args[:3]!r}")
        window_change = pending_change = added = removed = 0
        for cmd in call.inner:
            name, target = cmd[0].upper(), cmd[1] if len(cmd) > 1 else b""
            if name in _READS or target not in ours:
                continue
            if target == w and name == b"SET":
                after = sum(window_codec.decode(cmd[2]).buckets.values())
                window_change += after - window_total
                window_total = after
            elif target == pw and name == b"HINCRBY":
                pending[cmd[2]] = pending.get(cmd[2], 0) + int(cmd[3])
                pending_change += int(cmd[3])
            elif target == pw and name == b"HDEL":
                pending_change -= sum(pending.pop(f, 0) for f in cmd[2:])
            elif target == pr and name in (b"HSET", b"HSETNX"):
                added += (len(cmd) - 2) // 2
            elif target == pr and name == b"HDEL":
                removed += len(cmd) - 2
            # Version 2: bucket fields (digits), the sum (t), the queue's ends (h, n) and
            # each reservation's entry (r:<id>) in one hash; the queue holds no amount.
            elif target == pv and name == b"HSET":
                for f, v in zip(cmd[2::2], cmd[3::2], strict=True):
                    if f.isdigit():
                        pending_change += int(v) - pending.get(b"v2:" + f, 0)
                        pending[b"v2:" + f] = int(v)
                    added += f.startswith(b"r:")
            elif target == pv and name == b"HINCRBY" and cmd[2].isdigit():
                pending[b"v2:" + cmd[2]] = pending.get(b"v2:" + cmd[2], 0) + int(cmd[3])
                pending_change += int(cmd[3])
            elif target == pv and name == b"HDEL":
                pending_change -= sum(pending.pop(b"v2:" + f, 0) for f in cmd[2:] if f.isdigit())
                removed += sum(f.startswith(b"r:") for f in cmd[2:])
            elif target == pv and name == b"DEL":
                pending_change -= sum(v for f, v in pending.items() if f.startswith(b"v2:"))
                pending = {f: v for f, v in pending.items() if not f.startswith(b"v2:")}
            elif (target == pv and name == b"HINCRBY") or (target == pq and name in _QUEUE_WRITES):
                pass  # the version-2 sum ('t') and the queue: bookkeeping, no amount
            elif name not in (b"PEXPIRE", b"EXPIRE", b"PEXPIREAT"):
                raise AssertionError(f"unexpected write in a script: {cmd[:3]!r}")
        if window_change or pending_change or added or removed:
            steps.append((window_change, pending_change, added, removed))
    return steps


class TestAbsorption:
    @pytest.mark.parametrize("pending", ["version 1", "version 2"])
    async def test_absorbing_reservations_leaves_no_gap_and_no_double_count(
        self,
        pending: str,
        worker: subprocess.Popen[bytes],
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        admission_client: httpx.AsyncClient,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=10**6)
        await apply_policies(policy)
        key, prefix = f"{policy.id}|tenant=gap", worker_settings.redis_prefix
        if pending == "version 2":
            # A key whose worker already writes version-2 windows: admission holds its
            # reservations in the version-2 pending window (with no window yet: version 1).
            redis_sync.set(window_key(prefix, key), window_codec.encode({}, policy.bucket_ms))
        with monitored(redis_sync, prefix) as monitor:
            answers = await asyncio.gather(
                *(
                    admission_client.post(
                        "/v1/admit",
                        json={
                            "request_id": uuid.uuid4().hex,
                            "subject": {"tenant": "gap", "model": "m"},
                            "estimate": {"input_tokens": 100},
                        },
                    )
                    for _ in range(50)
                )
            )
            assert [a.status_code for a in answers] == [200] * 50
            samples: list[tuple[int, int]] = []
            for _ in range(3000):
                samples.append(_held(redis_sync, prefix, key))
                if samples[-1][1] == 0:
                    break
                await asyncio.sleep(0.01)
            calls = monitor.stop()
        assert samples[-1] == (5000, 0), "the worker did not absorb every reservation"
        pv = pending_total_key(prefix, key).encode()
        v2_holds = sum(
            1 for call in calls for cmd in call.inner if cmd[0].upper() == b"HSET" and cmd[1] == pv
        )
        assert (v2_holds > 0) == (pending == "version 2"), v2_holds
        assert samples[0][1] > 0, "absorbed before the first sample: nothing was observed"
        # At every sampled instant the reservations are held exactly once: in pending or
        # in the window. Sampling can miss a short gap; Redis's own record of every
        # command cannot: each step that changed the window or the pending entries was one
        # script call, and in each the window grew by exactly what left the pending
        # entries (100 a reservation absorbed), so no instant lies between the two.
        steps = _steps(calls, prefix, key)
        assert sum(a for _, _, a, _ in steps) == 50 == sum(r for _, _, _, r in steps), steps
        for window, pending, added, removed in steps:
            assert window + pending == 100 * added, steps  # an admit adds 100 to pending
            assert window == 100 * removed, steps  # an absorb moves 100 per reservation
        assert sum(window for window, _, _, _ in steps) == 5000, steps


class TestAbsorbScript:
    """The worker's absorb step on a pending window written by the real admit script."""

    async def test_absorb_moves_each_reservation_from_pending_to_the_window_once(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(limit=10_000, unit="input_tokens", window="60s", bucket="1s")
        await adm.policies(policy)
        key, spec = f"{policy.id}|tenant=abs", WindowSpec(60_000, 1000)
        rids = []
        for amount in (100, 200, 300):
            answer = await adm.admit("abs", input_tokens=amount)
            assert answer.status_code == 200
            rids.append(answer.json()["reservation_id"])
        pw, pr = pending_window_key(adm.prefix, key), pending_reservations_key(adm.prefix, key)
        records = {k.decode(): v.decode() for k, v in (await adm.redis.hgetall(pr)).items()}
        assert set(records) == set(rids)
        # Each record names the pending-window field (a bucket's last ms) and its amount.
        where = {rid: tuple(map(int, records[rid].split(":"))) for rid in rids}
        assert [a for _, a in where.values()] == [100, 200, 300]
        assert all(field % 1000 == 999 for field, _ in where.values())
        assert await adm.pending(key) == 600
        assert 0 < await adm.redis.pttl(pw) <= 61_000
        assert 0 < await adm.redis.pttl(pr) <= 61_000

        materializer = RedisMaterializer(adm.redis, adm.prefix)
        window: dict[int, int] = {}

        async def absorb(rid: str | None, *, write: bool = True) -> int:
            if rid is not None and write:
                field, amount = where[rid]
                window[field - 999] = window.get(field - 999, 0) + amount
            value = window_codec.encode(window, 1000) if write else None
            return await materializer.absorb(key, value, spec, [rid] if rid else [])

        assert await absorb(rids[0]) == 100
        assert await adm.pending(key) == 500
        stored = window_codec.decode(await adm.redis.get(window_key(adm.prefix, key)))
        assert sum(stored.buckets.values()) == 100
        assert await absorb(rids[0], write=False) == 0  # a duplicate reserve: nothing left
        assert await adm.pending(key) == 500
        assert await absorb(rids[1]) == 200
        assert await absorb(rids[2]) == 300
        assert not await adm.redis.exists(pw, pr), "empty hashes are gone"

    async def test_a_reservation_whose_bucket_was_pruned_leaves_nothing_negative(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        key, spec = "p|tenant=gone", WindowSpec(60_000, 1000)
        pw, pr = pending_window_key(key_prefix, key), pending_reservations_key(key_prefix, key)
        await redis_client.hset(pw, mapping={"5999": 70})
        await redis_client.hset(pr, mapping={"r-old": "1999:40", "r-new": "5999:30"})
        materializer = RedisMaterializer(redis_client, key_prefix)
        assert await materializer.absorb(key, None, spec, ["r-old", "r-new", "r-none"]) == 30
        assert await redis_client.hgetall(pw) == {b"5999": b"40"}
        assert await redis_client.hgetall(pr) == {}
        assert not await redis_client.exists(window_key(key_prefix, key))


class TestMemory:
    @pytest.mark.parametrize(("buckets", "limit_bytes"), [(1440, 16 * 1024), (60, 2 * 1024)])
    def test_redis_bytes_per_key(
        self, redis_sync: redis.Redis, key_prefix: str, buckets: int, limit_bytes: int
    ) -> None:
        minute = 60_000
        start = 1_800_000_000_000 - 1_800_000_000_000 % minute
        step = 1440 // buckets  # spread sparse buckets over the day
        state = {start + i * step * minute: 1_000_000 + i for i in range(buckets)}
        key = window_key(key_prefix, "daily-tokens|tenant=acme-corporation|api_key=k-1234567")
        redis_sync.set(key, window_codec.encode(state, minute))
        used = redis_sync.memory_usage(key)
        assert used is not None and used <= limit_bytes, used


def _hour_state(amount: int, version: int) -> KeyState:
    """A 1 h / 1 m key holding ``amount`` in one bucket, at ``version`` (records applied)."""
    state = KeyState(buckets={60_000: amount}, bucket_ms=60_000, window_ms=3_600_000)
    state.offsets = {0: version - 1}
    assert state.version == version
    return state


class TestHealScript:
    async def test_a_heal_never_overwrites_a_newer_window(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        client, prefix = redis_client, key_prefix
        materializer = RedisMaterializer(client, prefix)
        spec = WindowSpec(3_600_000, 60_000)
        newer = _hour_state(7, version=10)
        older = _hour_state(3, version=5)
        try:
            await materializer.absorb(
                "k", window_codec.encode(newer.buckets, 60_000), spec, [], version=newer.version
            )
            assert not await materializer.heal("k", older)  # Redis holds a newer window
            assert not await materializer.heal("k", newer)  # equal: nothing to do
            await client.set(window_key(prefix, "k"), window_codec.encode({60_000: 99}, 60_000))
            assert await materializer.heal("k", newer)  # same version, altered bytes
            raw = await client.get(window_key(prefix, "k"))
            assert window_codec.decode(raw).buckets == {60_000: 7}
            await client.delete(window_key(prefix, "k"))
            assert await materializer.heal("k", newer)  # a deleted window comes back
        finally:
            await client.delete(*[k async for k in client.scan_iter(prefix + "*")])

    async def test_a_window_behind_only_in_version_is_not_drift(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        # A record that moves the key's version without changing its window (a commit of
        # exactly its reservation, a duplicate) is not written to Redis: the window there
        # is right, only its version is behind. The heal brings the version forward and
        # reports no drift.
        client, prefix = redis_client, key_prefix
        materializer = RedisMaterializer(client, prefix)
        spec = WindowSpec(3_600_000, 60_000)
        older = _hour_state(7, version=5)
        same = _hour_state(7, version=10)  # the same window
        try:
            await materializer.absorb(
                "k", window_codec.encode(older.buckets, 60_000), spec, [], version=older.version
            )
            assert not await materializer.heal("k", same)
            assert int(await client.get(window_version_key(prefix, "k"))) == same.version
            assert not await materializer.heal("k", older)  # Redis now holds the newer version
        finally:
            await client.delete(*[k async for k in client.scan_iter(prefix + "*")])


class TestStaleWriter:
    async def test_a_batch_write_never_overwrites_a_newer_window(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        """A worker that lost the key's partition (its last batch still in flight) writes
        after the new owner: its older window must not replace the newer one, while the
        reservations it absorbed still leave the pending window."""
        client, prefix = redis_client, key_prefix
        materializer = RedisMaterializer(client, prefix)
        spec = WindowSpec(3_600_000, 60_000)
        key = "p|tenant=moved"

        def write(buckets: dict[int, int], last_offset: int, *absorbed: str) -> KeyWrite:
            state = KeyState(buckets=buckets, bucket_ms=60_000, window_ms=3_600_000)
            state.offsets = {2: last_offset}
            return KeyWrite(key, state, spec, True, True, dict.fromkeys(absorbed))

        pr = pending_reservations_key(prefix, key)
        pw = pending_window_key(prefix, key)
        await client.hset(pw, mapping={"59999": 5})
        await client.hset(pr, mapping={"r-1": "59999:5"})
        try:
            await materializer.write_batch([write({0: 12}, 11)])  # the new owner: version 12
            await materializer.write_batch([write({0: 9}, 8, "r-1")])  # the old one: 9
            stored = window_codec.decode(await client.get(window_key(prefix, key)))
            assert stored.buckets == {0: 12}
            assert await client.get(window_version_key(prefix, key)) == b"12"
            assert not await client.exists(pw, pr), "the stale writer's absorb still counts"
            await materializer.write_batch([write({0: 12, 60_000: 1}, 12)])  # newer: written
            stored = window_codec.decode(await client.get(window_key(prefix, key)))
            assert stored.buckets == {0: 12, 60_000: 1}
        finally:
            await client.delete(*[k async for k in client.scan_iter(prefix + "*")])

    async def test_a_large_batch_writes_every_key_and_absorbs_each_own_ids(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        """More keys than one script call takes, each with its own number of absorbed
        reservations: every window lands, every absorbed id leaves its own key only."""
        client, prefix = redis_client, key_prefix
        materializer = RedisMaterializer(client, prefix)
        spec = WindowSpec(3_600_000, 60_000)
        writes = []
        for i in range(150):
            key = f"p|tenant=t{i}"
            rids = [f"r{i}-{j}" for j in range(i % 4)]
            pr, pw = pending_reservations_key(prefix, key), pending_window_key(prefix, key)
            await client.hset(pw, mapping={"59999": 10 * len(rids) + 7})
            await client.hset(pr, mapping={"kept": "59999:7", **{r: "59999:10" for r in rids}})
            state = KeyState(buckets={0: i + 1}, bucket_ms=60_000, window_ms=3_600_000)
            state.offsets = {0: i}
            writes.append(KeyWrite(key, state, spec, True, True, dict.fromkeys(rids)))
        try:
            await materializer.write_batch(writes)
            for i, w in enumerate(writes):
                stored = window_codec.decode(await client.get(window_key(prefix, w.key)))
                assert stored.buckets == {0: i + 1}
                pending = await client.hgetall(pending_reservations_key(prefix, w.key))
                assert pending == {b"kept": b"59999:7"}
                held = await client.hgetall(pending_window_key(prefix, w.key))
                assert held == {b"59999": b"7"}
        finally:
            await client.delete(*[k async for k in client.scan_iter(prefix + "*")])


class TestUtilizationIndex:
    """The worker's window writes keep a sorted set of every window's total over its limit,
    under the same compare-and-set: the dashboard's top-N reads it, decoding nothing."""

    @staticmethod
    def _write(key: str, buckets: dict[int, int], last_offset: int) -> KeyWrite:
        state = KeyState(buckets=buckets, bucket_ms=60_000, window_ms=3_600_000)
        state.high_ms = max(buckets) + 1
        state.offsets = {0: last_offset}
        return KeyWrite(key, state, WindowSpec(3_600_000, 60_000), True, True)

    async def test_each_written_window_is_scored_by_its_total_over_its_limit(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        client, prefix = redis_client, key_prefix
        limits = {"tight": 100, "loose": 10_000}
        materializer = RedisMaterializer(client, prefix, limit_of=limits.get)
        writes = [self._write(f"tight|tenant=t{i}", {0: 10 * i, 60_000: 5}, i) for i in range(9)]
        writes.append(self._write("loose|tenant=t0", {0: 5000}, 1))
        writes.append(self._write("unknown|tenant=t0", {0: 1}, 1))  # no limit: no score
        try:
            await materializer.write_batch(writes)
            top = await client.zrevrange(utilization_key(prefix), 0, 2, withscores=True)
            assert top == [
                (window_key(prefix, "tight|tenant=t8").encode(), pytest.approx(0.85)),
                (window_key(prefix, "tight|tenant=t7").encode(), pytest.approx(0.75)),
                (window_key(prefix, "tight|tenant=t6").encode(), pytest.approx(0.65)),
            ]
            assert await client.zscore(
                utilization_key(prefix), window_key(prefix, "loose|tenant=t0")
            ) == pytest.approx(0.5)
            assert await client.zcard(utilization_key(prefix)) == 10
        finally:
            await client.delete(*[k async for k in client.scan_iter(prefix + "*")])

    async def test_a_stale_writer_moves_neither_window_nor_score_and_a_heal_rescores(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        client, prefix = redis_client, key_prefix
        materializer = RedisMaterializer(client, prefix, limit_of={"p": 100}.get)
        key = "p|tenant=moved"
        member = window_key(prefix, key)
        try:
            await materializer.write_batch([self._write(key, {0: 40}, 11)])  # version 12
            await materializer.write_batch([self._write(key, {0: 90}, 8)])  # stale: 9
            assert await client.zscore(utilization_key(prefix), member) == pytest.approx(0.4)
            healed = self._write(key, {0: 70}, 20).state  # the table moved on: version 21
            assert await materializer.heal(key, healed)
            assert await client.zscore(utilization_key(prefix), member) == pytest.approx(0.7)
        finally:
            await client.delete(*[k async for k in client.scan_iter(prefix + "*")])

    async def test_a_write_that_leaves_the_window_as_it_is_leaves_its_score(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        client, prefix = redis_client, key_prefix
        materializer = RedisMaterializer(client, prefix, limit_of={"p": 100}.get)
        key = "p|tenant=same"
        try:
            await materializer.write_batch([self._write(key, {0: 30}, 3)])
            untouched = self._write(key, {0: 99}, 4)
            untouched.window_changed = False  # only absorbed ids: no window, no score
            untouched.absorbed = {"r-x": None}
            await materializer.write_batch([untouched])
            assert await client.zscore(
                utilization_key(prefix), window_key(prefix, key)
            ) == pytest.approx(0.3)
        finally:
            await client.delete(*[k async for k in client.scan_iter(prefix + "*")])
