"""The per-key steps of ADMIT and EXTEND (``admission/scripts/key_steps.lua``): the O(1)
read of a version-2 window and pending window against the Python engine, holds and
absorbs in any order against a model, and a deployment in which the previous release's
worker still runs.

Every Lua test takes ``lua_server``: once on the real Redis and once embedded. The oracle
for used, reserved and Retry-After is the Python engine (``schemas.windows``: combine,
retry_after; itself checked against a brute force in ``test_window_lua``); for the reset
it is the rule written out below (``reset_oracle``), from the reply's documentation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from spendgate.schemas.redis_values import PendingEntry
from spendgate.schemas.window_codec import decode_pending, encode, read
from spendgate.schemas.windows import BOUNDARIES, Buckets, WindowSpec, add, combine, retry_after
from spendgate.streams.scripts import absorb
from spendgate.streams.scripts.absorb import AbsorbArgs, AbsorbKey
from tests.fixtures import held
from tests.fixtures.embedded_lua import LuaServer, harness
from tests.fixtures.seeds import derive

KEY_CHECK = harness("key_check")
PREVIOUS_ABSORB = harness("absorb_previous_release")
SEED = derive("test_key_steps_lua")
BATCH = 250


def keys(prefix: str, index: int | str) -> list[str]:
    """The five held keys of one case (the layout of ``redis_keys.held_keys``)."""
    return [f"{prefix}{kind}:{index}" for kind in ("w", "pw", "pv", "pq", "pr")]


def pending_last(t_ms: int, width: int) -> int:
    return t_ms - t_ms % width + width - 1


def reset_oracle(spec: WindowSpec, buckets: dict[int, int], t_ms: int, own: int) -> int:
    """Ms until every amount counted at t_ms has aged out (and own, held in the bucket of
    t_ms): the newest non-zero bucket that still counts, plus the window (and the rest of
    its bucket unless the boundary bucket is excluded)."""
    b, w = spec.bucket_ms, spec.window_ms
    head = t_ms - t_ms % b
    oldest = head - w + (b if spec.boundary == "exclude" else 0)
    counted = [s for s, a in buckets.items() if a and s >= oldest]
    last = max(counted) if counted else None
    if own > 0 and (last is None or head > last):
        last = head
    if last is None:
        return 0
    gone = last + w + (0 if spec.boundary == "exclude" else b - 1)
    return max(0, gone - t_ms)


@dataclass
class KeyCase:
    """One budget key as Redis holds it, and one request."""

    spec: WindowSpec
    buckets: Buckets
    #: The absorbed window's format version (None: no window key).
    version: int | None
    #: The width the window was written in (a policy whose bucket changed since).
    stored_ms: int
    t_ms: int
    limit: int
    amount: int
    own: int
    pending1: dict[int, int] = field(default_factory=dict)
    pending2: dict[int, int] = field(default_factory=dict)
    #: The version-2 queue: fields oldest first, some no longer in the hash.
    queue: list[int] = field(default_factory=list)

    def raw(self) -> bytes | None:
        if self.version is None:
            return None
        return encode(self.buckets, self.stored_ms, version=self.version)

    def expected(self) -> list[int]:
        spec = self.spec
        absorbed = read(self.raw(), spec.bucket_ms)
        pending = decode_pending(
            {
                **{str(k): v for k, v in self.pending1.items()},
                **{f"{k}": v + self.pending1.get(k, 0) for k, v in self.pending2.items()},
            },
            spec.bucket_ms,
        )
        h = combine(spec, absorbed, pending, self.t_ms)
        fit = retry_after(spec, h.buckets, self.t_ms, limit=self.limit, amount=self.amount)
        fits_at = -1 if fit.fits_at_ms is None else fit.fits_at_ms
        reset = reset_oracle(spec, h.buckets, self.t_ms, self.own)
        return [max(0, h.absorbed), h.pending, reset, fits_at, int(fit.never_fits)]

    def write(self, pipe: object, names: list[str]) -> None:
        w, pw, pv, pq, pr = names
        pipe.delete(w, pw, pv, pq, pr)  # type: ignore[attr-defined]
        raw = self.raw()
        if raw is not None:
            pipe.set(w, raw)  # type: ignore[attr-defined]
        if self.pending1:
            pipe.hset(pw, mapping={str(k): v for k, v in self.pending1.items()})  # type: ignore[attr-defined]
        if self.pending2:
            mapping: dict[str, int] = {str(k): v for k, v in self.pending2.items()}
            mapping["t"] = sum(self.pending2.values())
            pipe.hset(pv, mapping=mapping)  # type: ignore[attr-defined]
        if self.queue:
            pipe.rpush(pq, *[str(f) for f in self.queue])  # type: ignore[attr-defined]
            if self.pending2:  # the queue's ends, kept in the hash
                ends = {"h": self.queue[0], "n": self.queue[-1]}
                pipe.hset(pv, mapping=ends)  # type: ignore[attr-defined]

    def argv(self) -> list[int | str]:
        s = self.spec
        return ["read", self.t_ms, s.window_ms, s.bucket_ms, s.boundary, self.limit]


def random_key_case(rng: random.Random) -> KeyCase:
    bucket_ms = rng.choice([1000, 2000, 5000, 60_000])
    spec = WindowSpec(rng.randint(1, 30) * bucket_ms, bucket_ms, rng.choice(BOUNDARIES))
    origin = rng.randrange(0, 2**41)
    t_ms = origin + rng.randint(0, 3 * spec.window_ms)
    if rng.random() < 0.4:  # a bucket edge
        t_ms = t_ms - t_ms % bucket_ms + rng.choice([-1, 0, 1, bucket_ms - 1])
    signed = rng.random() < 0.25
    future = rng.random() < 0.15
    buckets: Buckets = {}
    for _ in range(rng.randint(0, 40)):
        at = t_ms - rng.randint(0, spec.window_ms + 3 * bucket_ms)
        if future and rng.random() < 0.2:
            at = t_ms + rng.randint(1, 2 * bucket_ms)
        add(spec, buckets, at, rng.randint(-500 if signed else 1, 1000))
    version = rng.choices([2, 1, None], [0.75, 0.15, 0.1])[0]
    if version is None:
        buckets = {}
    stored_ms = bucket_ms
    if rng.random() < 0.1:  # the policy's bucket changed since the window was written
        stored_ms = rng.choice([w for w in (1000, 2000, 5000, 60_000) if w != bucket_ms])
        buckets = {s - s % stored_ms: a for s, a in buckets.items()}
        merged: Buckets = {}
        for s, a in buckets.items():
            merged[s] = merged.get(s, 0) + a
        buckets = {s: a for s, a in merged.items() if a}
    pending2: dict[int, int] = {}
    queue: list[int] = []
    if rng.random() < 0.7:
        at = t_ms - rng.randint(0, spec.window_ms + 4 * bucket_ms)
        while at <= t_ms:
            width = bucket_ms if rng.random() < 0.9 else rng.choice([1000, 5000])
            last = pending_last(at, width)
            if not queue or last > queue[-1]:
                queue.append(last)
                if rng.random() < 0.75:  # else absorbed away: still queued
                    pending2[last] = rng.randint(1, 800)
            at += rng.randint(1, 3 * bucket_ms)
        if rng.random() < 0.03:  # the queue expired apart from the hash
            queue = []
    pending1: dict[int, int] = {}
    if rng.random() < 0.15:
        for _ in range(rng.randint(1, 4)):
            last = pending_last(t_ms - rng.randint(0, spec.window_ms + bucket_ms), bucket_ms)
            pending1[last] = pending1.get(last, 0) + rng.randint(1, 800)
    case = KeyCase(spec, buckets, version, stored_ms, t_ms, 0, rng.randint(0, 600), 0)
    case.pending1, case.pending2, case.queue = pending1, pending2, queue
    case.own = rng.choice([0, 0, rng.randint(1, 100)])
    now_total = case.expected()[0] + case.expected()[1]
    if rng.random() < 0.3:
        case.limit = rng.randint(0, 40_000)
    else:  # just short: fits only once some of it ages out
        case.limit = max(0, now_total + case.amount - rng.randint(1, max(1, abs(now_total))))
    return case


def dense_day_case(rng: random.Random) -> KeyCase:
    """24 h of 1 min buckets, every one non-empty, reservations pending in the last few."""
    spec = WindowSpec(86_400_000, 60_000, rng.choice(BOUNDARIES))
    t_ms = 1_700_000_000_000 + rng.randrange(0, 60_000)
    buckets: Buckets = {}
    for minute in range(1441):
        add(spec, buckets, t_ms - minute * 60_000, rng.randint(1, 2**30))
    queue = [pending_last(t_ms - m * 60_000, 60_000) for m in range(rng.randint(0, 3), -1, -1)]
    pending2 = {f: rng.randint(1, 2**20) for f in queue}
    amount = rng.randint(1, 2**31)
    case = KeyCase(spec, buckets, 2, 60_000, t_ms, 0, amount, rng.choice([0, 5]))
    case.pending2, case.queue = pending2, queue
    used, reserved = case.expected()[:2]
    case.limit = max(amount, used + reserved + amount - rng.randint(1, used))
    return case


def run(lua: LuaServer, cases: list[KeyCase], tag: str) -> list[list[int]]:
    script = lua.script(KEY_CHECK)
    out: list[list[int]] = []
    for first in range(0, len(cases), BATCH):
        pipe = lua.client.pipeline(transaction=False)
        for index, case in enumerate(cases[first : first + BATCH], start=first):
            names = keys(lua.prefix, f"{tag}{index}")
            case.write(pipe, names)
            script(keys=names, args=[*case.argv(), case.amount, case.own], client=pipe)
        out.extend(r for r in pipe.execute() if isinstance(r, list))
    return out


class TestReadMatchesPython:
    def test_random_keys(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED)
        cases = [random_key_case(rng) for _ in range(2_000)]
        fast = 0
        for case, got in zip(cases, run(lua_server, cases, "r"), strict=True):
            assert got[:5] == case.expected(), case
            fast += got[5]
            if got[5]:  # read in place only from a version-2 value in the policy's width
                stored = case.stored_ms == case.spec.bucket_ms
                assert case.version is None or (case.version == 2 and stored), case
                assert not case.pending1, case
        assert fast > len(cases) // 3  # the O(1) path is what most cases took

    def test_dense_day_windows_are_read_in_place(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED + 1)
        cases = [dense_day_case(rng) for _ in range(40)]
        for case, got in zip(cases, run(lua_server, cases, "d"), strict=True):
            assert got == [*case.expected(), 1], (case.spec, case.t_ms, case.limit)

    @pytest.mark.parametrize("older", [0, 5, 31, 32])
    def test_every_retry_offset_of_a_full_day_read_in_ranges(
        self, lua_server: LuaServer, older: int
    ) -> None:
        # A uniform dense day: the limit picks how many buckets must age out, so the answers
        # fall on every offset around the summary's strides (32 slots) and at the ends;
        # buckets older than the window shift where the strides fall.
        spec = WindowSpec(86_400_000, 60_000, "prorate")
        t = 1_700_000_000_000 + 12_345
        head = t - t % 60_000
        buckets = {head - m * 60_000: 100 for m in range(1440 + older)}
        cases = []
        for out in [*range(0, 70), *range(1370, 1441)]:
            case = KeyCase(spec, dict(buckets), 2, 60_000, t, 0, 50, 0)
            case.limit = 100 * (1440 - out) + 50 - 1
            cases.append(case)
        for case, got in zip(cases, run(lua_server, cases, "u"), strict=True):
            assert got == [*case.expected(), 1], case.limit

    def test_a_refund_cancelling_what_is_pending_in_the_newest_bucket(
        self, lua_server: LuaServer
    ) -> None:
        # The newest bucket nets to zero (absorbed -30, pending +30): the reset is the
        # older bucket's, as if the newest were empty.
        spec = WindowSpec(60_000, 1_000, "include")
        t = 1_700_000_000_250
        head = t - t % 1_000
        case = KeyCase(spec, {head - 3_000: 100, head: -30}, 2, 1_000, t, 1_000, 1, 0)
        case.pending2, case.queue = {head + 999: 30}, [head + 999]
        got = run(lua_server, [case], "c")[0]
        assert got[:5] == case.expected()
        assert got[2] == head - 3_000 + 60_000 + 999 - t

    def test_a_queue_lost_apart_from_its_hash_is_rebuilt_by_the_next_hold(
        self, lua_server: LuaServer
    ) -> None:
        spec = WindowSpec(60_000, 1_000, "include")
        t = 1_700_000_000_250
        names = keys(lua_server.prefix, "lost")
        client = lua_server.client
        client.set(names[0], encode({}, spec.bucket_ms))
        client.hset(names[2], mapping={str(t - 250 + 999): 5, str(t - 2_250 + 999): 7, "t": 12})
        client.pexpire(names[2], 30_000)
        hold = lua_server.script(KEY_CHECK)
        argv = ["hold", t, spec.window_ms, spec.bucket_ms, spec.boundary, 10**9, 3, "r"]
        assert hold(keys=names, args=argv) == [0, 12, 0]  # counted, read whole
        assert client.hgetall(names[2]) == {
            str(t - 250 + 999).encode(): b"8",
            str(t - 2_250 + 999).encode(): b"7",
            b"t": b"15",
            b"r:r": f"{t - 250 + 999}:3".encode(),
            b"h": str(t - 2_250 + 999).encode(),
            b"n": str(t - 250 + 999).encode(),
        }
        assert client.lrange(names[3], 0, -1) == [
            str(t - 2_250 + 999).encode(),
            str(t - 250 + 999).encode(),
        ]
        assert 0 < client.pttl(names[3]) <= 30_000
        assert held.pending_v2_consistent(client, lua_server.prefix, "lost")


@dataclass
class Reservation:
    rid: str
    field: int
    amount: int


class TestHoldsAndAbsorbs:
    """Holds and absorbs in random order on one key, the clock mostly forward: after every
    step the key reads as the Python engine reads Redis, the version-2 sum is the sum of its
    buckets and its queue is ordered, and what is pending is what the model holds open."""

    def test_random_steps_against_a_model(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED + 2)
        spec = WindowSpec(10_000, 1_000, "prorate")
        names = keys(lua_server.prefix, "steps")
        client = lua_server.client
        client.set(names[0], encode({1_700_000_000_000: 50}, spec.bucket_ms))
        hold = lua_server.script(KEY_CHECK)
        absorb_script = lua_server.script(absorb.SCRIPT.source)
        part = AbsorbKey(*names[:5], f"{names[0]}:v", f"{names[0]}:u", None, spec.window_ms)
        t = latest = 1_700_000_000_000
        open_: list[Reservation] = []
        for step in range(400):
            t += rng.choice([0, 7, 150, 400, 999, 1_000, 3_000, -120])
            if rng.random() < 0.02:
                t += 12_000  # idle past the whole window
            if open_ and rng.random() < 0.35:
                r = open_.pop(rng.randrange(len(open_)))
                args = AbsorbArgs([replace(part, reservation_ids=(r.rid,))])
                moved = absorb_script(keys=args.keys(), args=args.argv())
                # All of it, unless its bucket left the window and a hold or read pruned it:
                # by the latest clock a script ran at (absorb takes none), since a bucket
                # pruned stays pruned when the clock then steps back (the documented rule;
                # the oracle once used the current clock).
                first_live = latest + 1 - (latest + 1) % spec.bucket_ms - spec.window_ms
                start = r.field - r.field % spec.bucket_ms
                assert moved == r.amount or (moved == 0 and start < first_live)
            else:
                amount = rng.randint(1, 40)
                rid = f"r{step}"
                argv = ["hold", t, spec.window_ms, spec.bucket_ms, spec.boundary, 10**9]
                hold(keys=names, args=[*argv, amount, rid])
                entry = PendingEntry.decode(client.hget(names[2], f"r:{rid}"))
                assert entry.amount == amount
                # In the bucket of now, or (the clock went back) a newer one: never older.
                assert entry.field >= pending_last(t, spec.bucket_ms)
                open_.append(Reservation(rid, entry.field, amount))
            assert held.pending_v2_consistent(client, lua_server.prefix, "steps")
            for name in names[2:]:  # never without an expiry, never past window + bucket
                assert client.pttl(name) in (-2, *range(1, spec.window_ms + spec.bucket_ms + 1))
            latest = max(latest, t)
            self._check(lua_server, names, spec, t, latest, open_)

    @staticmethod
    def _check(
        lua: LuaServer,
        names: list[str],
        spec: WindowSpec,
        t: int,
        latest: int,
        open_: list[Reservation],
    ) -> None:
        client = lua.client
        raw = client.get(names[0])
        pending = client.hgetall(names[2])
        pending = {f: a for f, a in pending.items() if f.isdigit()}
        absorbed = read(raw, spec.bucket_ms)
        h = combine(spec, absorbed, decode_pending(pending, spec.bucket_ms), t)
        argv = ["read", t, spec.window_ms, spec.bucket_ms, spec.boundary, 10**9, 1, 0]
        got = lua.script(KEY_CHECK)(keys=names, args=argv)
        assert got[:2] == [max(0, h.absorbed), h.pending]
        assert got[2] == reset_oracle(spec, h.buckets, t, 0)
        # What still counts is exactly the open reservations whose bucket has not aged out
        # (by the latest clock seen: a bucket pruned stays pruned if the clock goes back).
        first_live = latest + 1 - (latest + 1) % spec.bucket_ms - spec.window_ms
        model = sum(r.amount for r in open_ if r.field - r.field % spec.bucket_ms >= first_live)
        kept = decode_pending(pending, spec.bucket_ms)
        assert sum(a for s, a in kept.items() if s >= first_live) == model


class TestMixedDeployment:
    """Admission upgraded first, then the worker; a partition back on an old worker."""

    def test_previous_worker_then_new_worker_then_a_partition_on_an_old_one(
        self, lua_server: LuaServer
    ) -> None:
        spec = WindowSpec(60_000, 1_000, "include")
        names = keys(lua_server.prefix, "mixed")
        client = lua_server.client
        hold = lua_server.script(KEY_CHECK)
        old_absorb = lua_server.script(PREVIOUS_ABSORB)
        new_absorb = lua_server.script(absorb.SCRIPT.source)
        t = 1_700_000_000_500
        base = ["hold", t, spec.window_ms, spec.bucket_ms, spec.boundary, 10**9]
        read_argv = ["read", t, spec.window_ms, spec.bucket_ms, spec.boundary, 10**9, 1, 0]

        def reserved() -> int:
            return int(hold(keys=names, args=read_argv)[1])

        def old_keys() -> list[str]:  # the previous release's 5 KEYS per budget key
            return [names[0], names[1], names[4], f"{names[0]}:v", f"{names[0]}:u"]

        # 1. The previous release's worker writes version-1 windows: holds go to version 1,
        #    which its absorb moves out.
        client.set(names[0], encode({t - 5_500: 100}, spec.bucket_ms, version=1))
        hold(keys=names, args=[*base, 30, "a"])
        assert client.hget(names[4], "a") is not None and not client.exists(names[2])
        assert reserved() == 30
        assert old_absorb(keys=old_keys(), args=["", 120_000, "", "", 1, "a"]) == 30
        assert reserved() == 0
        hold(keys=names, args=[*base, 20, "b"])  # still pending when the worker upgrades
        # 2. The new worker rewrites the window as version 2: new holds go to version 2,
        #    both versions count, the new absorb moves out either.
        client.set(names[0], encode({t - 5_500: 100}, spec.bucket_ms))
        hold(keys=names, args=[*base, 7, "c"])
        assert client.hget(names[2], "r:c") is not None
        assert reserved() == 27
        part = AbsorbKey(*names[:5], f"{names[0]}:v", f"{names[0]}:u", None, spec.window_ms)
        both = AbsorbArgs([replace(part, reservation_ids=("b", "c"))])
        assert new_absorb(keys=both.keys(), args=both.argv()) == 27
        assert reserved() == 0
        assert not client.exists(names[1], names[2], names[3], names[4])
        # 3. A partition back on an old worker during the rollout: its absorb does not know
        #    version 2 and moves nothing (no error); the amount keeps counting (never
        #    under) until the new absorb takes it, or its bucket ages out.
        hold(keys=names, args=[*base, 9, "d"])
        assert old_absorb(keys=old_keys(), args=["", 120_000, "", "", 1, "d"]) == 0
        assert reserved() == 9
        late = ["read", t + spec.window_ms + 1_000, *read_argv[2:]]
        assert int(hold(keys=names, args=late)[1]) == 0
        one = AbsorbArgs([replace(part, reservation_ids=("d",))])
        assert new_absorb(keys=one.keys(), args=one.argv()) == 9
        assert reserved() == 0
