"""The Lua window engine, against the Python engine and a brute force, in a real Redis and
embedded.

The twin comparison (Lua == Python) proves the two agree; the brute-force comparison
(``tests/schemas/reference.py``, which imports neither engine) proves what they agree on
is the documented window semantics. Every test that runs Lua takes ``lua_server``: once on
the real Redis (``integration``) and once embedded (fakeredis + lupa, see
``tests/fixtures/embedded_lua.py``), so the fast test run covers them without a server.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import struct
from dataclasses import dataclass

import pytest
import redis

from spendgate.schemas.luascript import text_of
from spendgate.schemas.window_codec import decode_pending, encode
from spendgate.schemas.windows import (
    BOUNDARIES,
    MAX_BUCKET_MS,
    Buckets,
    WindowSpec,
    add,
    combine,
    rebucket,
    retry_after,
    total,
)
from tests.fixtures.embedded_lua import STRUCT_SHIM, LuaServer, harness
from tests.fixtures.seeds import derive, rng
from tests.schemas import reference

WINDOW_LUA_LIB = text_of("spendgate.schemas", "window")
WINDOW_CHECK_SCRIPT = harness("window_check")

#: This run's seed for the random cases (from SPENDGATE_TEST_SEED when set).
SEED = derive("test_window_lua")
CASES = 4_000
BATCH = 500


@dataclass(frozen=True)
class Case:
    """One engine query: spec, absorbed and pending state, time and request."""

    spec: WindowSpec
    buckets: Buckets
    t_ms: int
    limit: int
    extra: int
    amount: int
    #: The pending-window hash: a bucket's last millisecond -> amount (any width).
    pending: dict[int, int] = dataclasses.field(default_factory=dict)

    def python(self) -> list[int]:
        pending = decode_pending({str(k): v for k, v in self.pending.items()}, self.spec.bucket_ms)
        held = combine(self.spec, self.buckets, pending, self.t_ms)
        answer = retry_after(
            self.spec,
            held.buckets,
            self.t_ms,
            limit=self.limit,
            amount=self.amount,
            extra=self.extra,
        )
        fits_at = -1 if answer.fits_at_ms is None else answer.fits_at_ms
        combined = total(self.spec, held.buckets, self.t_ms)
        return [combined, fits_at, int(answer.never_fits), held.absorbed, held.pending]

    def argv(self) -> list[int | str]:
        spec = self.spec
        return [
            self.t_ms,
            spec.window_ms,
            spec.bucket_ms,
            spec.boundary,
            self.limit,
            self.extra,
            self.amount,
        ]


def random_case(rng: random.Random) -> Case:
    """Small windows mostly; sometimes wide buckets, epoch-scale times, huge amounts."""
    if rng.random() < 0.8:
        bucket_ms = rng.randint(1, 5) * 1000
        spec_buckets = rng.randint(1, 20)
    else:
        bucket_ms = rng.choice([60_000, 3_600_000, 86_400_000, 7 * 86_400_000, MAX_BUCKET_MS])
        spec_buckets = rng.randint(1, 3 if bucket_ms > 86_400_000 else 40)
    spec = WindowSpec(spec_buckets * bucket_ms, bucket_ms, rng.choice(BOUNDARIES))
    origin = rng.choice([0, rng.randrange(0, 2**42)])
    span_ms = 3 * spec.window_ms
    huge = rng.random() < 0.25
    signed = rng.random() < 0.5
    scale = 2**48 if huge else 1000
    buckets: Buckets = {}
    for _ in range(rng.randint(0, 25)):
        amount = rng.randint(-scale if signed else 0, scale)
        add(spec, buckets, origin + rng.randint(0, span_ms), amount)
    t_ms = origin + rng.randint(-bucket_ms, span_ms + spec.window_ms + 2 * bucket_ms)
    if rng.random() < 0.4:  # a bucket edge: r = bucket_ms - 1, 0 or 1
        t_ms = max(0, t_ms - t_ms % bucket_ms + rng.choice([-1, 0, 1]))
    t_ms = max(0, t_ms)
    pending = random_pending(rng, spec, origin, span_ms, scale) if rng.random() < 0.6 else {}
    amount = rng.randint(0, scale)
    extra = rng.randint(0, scale // 2)
    now = total(spec, buckets, t_ms) + sum(pending.values())
    if rng.random() < 0.3:
        limit = rng.randint(0, 4 * scale)
    else:  # short of the limit by part of the current total: fits only later
        limit = max(0, now + extra + amount - rng.randint(1, max(1, abs(now))))
    return Case(spec, buckets, t_ms, limit, extra, amount, pending)


def random_pending(
    rng: random.Random, spec: WindowSpec, origin: int, span_ms: int, scale: int
) -> dict[int, int]:
    """Pending-window fields: mostly the policy's width, sometimes an older one (the
    policy's bucket changed while reservations were pending); some long aged out."""
    pending: dict[int, int] = {}
    for _ in range(rng.randint(1, 8)):
        width = spec.bucket_ms if rng.random() < 0.7 else rng.randint(1, 6) * 1000
        at = origin + rng.randint(0, span_ms)
        last = at - at % width + width - 1
        pending[last] = pending.get(last, 0) + rng.randint(0, scale)
    return pending


def dense_day_case(rng: random.Random) -> Case:
    """A full 24 h window of 1 min buckets with large amounts: the dense layout."""
    spec = WindowSpec(86_400_000, 60_000, rng.choice(BOUNDARIES))
    t_ms = 1_700_000_000_000 + rng.randrange(0, 60_000)
    buckets: Buckets = {}
    for minute in range(1441):
        add(spec, buckets, t_ms - minute * 60_000, rng.randint(0, 2**42))
    now = total(spec, buckets, t_ms)
    amount = rng.randint(0, 2**42)
    limit = max(amount, now + amount - rng.randint(1, now))
    return Case(spec, buckets, t_ms, limit, 0, amount)


def sparse_day_case(rng: random.Random) -> Case:
    """A 24 h window with a few hundred scattered minutes: the sparse layout, many chunks."""
    spec = WindowSpec(86_400_000, 60_000, rng.choice(BOUNDARIES))
    t_ms = 1_700_000_000_000 + rng.randrange(0, 60_000)
    buckets: Buckets = {}
    for minute in rng.sample(range(1441), rng.randint(129, 170)):  # at most 2 KB sparse
        add(spec, buckets, t_ms - minute * 60_000, rng.randint(-(2**40), 2**42))
    assert encode(buckets, spec.bucket_ms)[1] == 0  # sparse
    amount = rng.randint(0, 2**42)
    return Case(spec, buckets, t_ms, rng.randint(amount, 2**50), rng.randint(0, 2**40), amount)


def run_lua(lua: LuaServer, cases: list[Case]) -> list[list[int]]:
    script = lua.script(WINDOW_CHECK_SCRIPT)
    results: list[list[int]] = []
    for first in range(0, len(cases), BATCH):
        pipe = lua.client.pipeline(transaction=False)
        for index, case in enumerate(cases[first : first + BATCH], start=first):
            key, pkey = f"{lua.prefix}w{index}", f"{lua.prefix}pw{index}"
            pipe.set(key, encode(case.buckets, case.spec.bucket_ms))
            pipe.delete(pkey)
            if case.pending:
                pipe.hset(pkey, mapping={str(k): v for k, v in case.pending.items()})
            script(keys=[key, pkey], args=case.argv(), client=pipe)
        replies = pipe.execute()
        scripted = [r for r in replies if isinstance(r, list)]
        results.extend(scripted)
    return results


class TestWindowLuaLib:
    def test_lib_reads_no_keys_or_argv_and_defines_only_locals(self) -> None:
        assert "KEYS" not in WINDOW_LUA_LIB
        assert "ARGV" not in WINDOW_LUA_LIB
        for line in WINDOW_LUA_LIB.splitlines():
            if line.startswith("function") or re.match(r"^[A-Za-z_]\w*\s*=", line):
                pytest.fail(f"global definition in WINDOW_LUA_LIB: {line!r}")

    def test_missing_key_is_an_empty_state(self, lua_server: LuaServer) -> None:
        script = lua_server.script(WINDOW_CHECK_SCRIPT)
        reply = script(
            keys=[f"{lua_server.prefix}absent"], args=[65_000, 60_000, 10_000, "include", 10, 0, 3]
        )
        assert reply == [0, 65_000, 0, 0, 0]

    def test_never_fits(self, lua_server: LuaServer) -> None:
        script = lua_server.script(WINDOW_CHECK_SCRIPT)
        reply = script(
            keys=[f"{lua_server.prefix}absent"], args=[0, 60_000, 10_000, "prorate", 10, 0, 11]
        )
        assert reply == [0, -1, 1, 0, 0]

    @pytest.mark.parametrize("new_bucket_ms", [5_000, 10_000, 15_000, 20_000])
    def test_a_changed_bucket_width_is_rebucketed_like_the_worker(
        self, lua_server: LuaServer, new_bucket_ms: int
    ) -> None:
        rng = random.Random(SEED + new_bucket_ms)
        t_ms = 1_700_000_000_000 + rng.randrange(60_000)
        old: Buckets = {}
        for _ in range(40):
            start = t_ms - rng.randrange(0, 120_000)
            start -= start % 10_000
            old[start] = old.get(start, 0) + rng.randint(1, 1000)
        spec = WindowSpec(60_000, new_bucket_ms, "include")
        moved = rebucket(old, 10_000, new_bucket_ms)
        key = f"{lua_server.prefix}w"
        lua_server.client.set(key, encode(old, 10_000))
        script = lua_server.script(WINDOW_CHECK_SCRIPT)
        args = [t_ms, 60_000, new_bucket_ms, "include", 10**9, 0, 1]
        assert script(keys=[key], args=args)[0] == total(spec, moved, t_ms)

    def test_unknown_boundary_is_an_error(self, lua_server: LuaServer) -> None:
        script = lua_server.script(WINDOW_CHECK_SCRIPT)
        with pytest.raises(redis.ResponseError, match="unknown boundary"):
            script(keys=[f"{lua_server.prefix}absent"], args=[0, 60_000, 10_000, "half", 10, 0, 1])


MULDIV_SCRIPT = (
    WINDOW_LUA_LIB
    + """
local out = {}
for i = 1, #ARGV, 3 do
  out[#out + 1] = window_ceil_muldiv(tonumber(ARGV[i]), tonumber(ARGV[i + 1]),
    tonumber(ARGV[i + 2]))
end
return out
"""
)


def muldiv_cases(rng: random.Random) -> list[tuple[int, int, int]]:
    """Extremes, remainders of exactly 1 and b - 1, and random triples."""
    top = 2**53 - 1
    cases: list[tuple[int, int, int]] = []
    for bucket_ms in (1_000, 60_000, 86_400_000, MAX_BUCKET_MS):
        for x in (top, -top, top - 1, -(top - 1), 1, -1, 0, bucket_ms, -bucket_ms):
            for k in (0, 1, bucket_ms // 2, bucket_ms - 1):
                cases.append((x, k, bucket_ms))
        for _ in range(200):
            k = rng.randrange(1, bucket_ms) | 1
            while math.gcd(k, bucket_ms) != 1:
                k = rng.randrange(1, bucket_ms) | 1
            inverse = pow(k, -1, bucket_ms)  # x * k = 1 (mod bucket_ms)
            x = inverse + bucket_ms * rng.randrange(0, (top - inverse) // bucket_ms)
            cases += [(x, k, bucket_ms), (-x, k, bucket_ms)]
            cases.append((rng.randint(-top, top), rng.randrange(0, bucket_ms), bucket_ms))
    return cases


class TestExactArithmetic:
    def test_prorated_share_is_exact_at_the_limits(self, lua_server: LuaServer) -> None:
        script = lua_server.script(MULDIV_SCRIPT)
        cases = muldiv_cases(random.Random(SEED))
        for first in range(0, len(cases), 300):
            chunk = cases[first : first + 300]
            got = script(keys=[], args=[value for triple in chunk for value in triple])
            expected = [-((-x * k) // b) for x, k, b in chunk]
            assert got == expected


@dataclass(frozen=True)
class RawCase:
    """A query on raw events: the brute force sees the events, Lua their encoded buckets."""

    window_ms: int
    bucket_ms: int
    boundary: str
    events: list[tuple[int, int]]
    t_ms: int
    limit: int
    extra: int
    amount: int

    @property
    def buckets(self) -> dict[int, int]:
        return reference.buckets_of(self.bucket_ms, self.events)

    def total_at(self, at_ms: int) -> int:
        return reference.reference_total(
            self.window_ms, self.bucket_ms, self.boundary, self.events, at_ms
        )

    def fits(self, at_ms: int) -> bool:
        return self.total_at(at_ms) + self.extra + self.amount <= self.limit


def raw_case(rand: random.Random) -> RawCase:
    """Small windows, signed or not, queries on bucket edges, limits that fit only later."""
    bucket_ms = rand.randint(1, 5) * 1000
    window_ms = rand.randint(1, 20) * bucket_ms
    origin = rand.choice([0, rand.randrange(0, 2**42)])
    span_ms = 3 * window_ms
    signed = rand.random() < 0.5
    events = [
        (origin + rand.randint(0, span_ms), rand.randint(-1000 if signed else 0, 1000))
        for _ in range(rand.randint(0, 25))
    ]
    t_ms = max(0, origin + rand.randint(-bucket_ms, span_ms + window_ms + 2 * bucket_ms))
    if rand.random() < 0.4:
        t_ms = max(0, t_ms - t_ms % bucket_ms + rand.choice([-1, 0, 1]))
    boundary = rand.choice(BOUNDARIES)
    amount, extra = rand.randint(0, 1000), rand.randint(0, 500)
    now = reference.reference_total(window_ms, bucket_ms, boundary, events, t_ms)
    if rand.random() < 0.3:
        limit = rand.randint(0, 4000)
    else:
        limit = max(0, now + extra + amount - rand.randint(1, max(1, abs(now))))
    return RawCase(window_ms, bucket_ms, boundary, events, t_ms, limit, extra, amount)


class TestLuaMatchesBruteForce:
    def test_totals_and_retry_after_follow_the_documented_semantics(
        self, lua_server: LuaServer
    ) -> None:
        rand = rng("test_window_lua.brute_force")
        cases = [raw_case(rand) for _ in range(1_500)]
        script = lua_server.script(WINDOW_CHECK_SCRIPT)
        answers: list[list[int]] = []
        for first in range(0, len(cases), BATCH):
            pipe = lua_server.client.pipeline(transaction=False)
            for index, case in enumerate(cases[first : first + BATCH], start=first):
                key = f"{lua_server.prefix}bf{index}"
                pipe.set(key, encode(case.buckets, case.bucket_ms))
                argv = [case.t_ms, case.window_ms, case.bucket_ms, case.boundary]
                script(keys=[key], args=[*argv, case.limit, case.extra, case.amount], client=pipe)
            answers.extend(pipe.execute()[1::2])
        for case, (lua_total, fits_at, never_fits, *_pending) in zip(cases, answers, strict=True):
            assert lua_total == case.total_at(case.t_ms), case
            if case.amount > case.limit:
                assert never_fits == 1 and fits_at == -1, case
                continue
            assert never_fits == 0, case
            if fits_at == -1:  # never, assuming no new usage: no period end fits either
                newest = max((o for o, _ in case.events), default=case.t_ms)
                horizon = max(case.t_ms, newest + case.window_ms + case.bucket_ms)
                ends = reference.period_ends(case.bucket_ms, case.t_ms, horizon)
                assert not any(case.fits(at) for at in ends), case
                continue
            assert fits_at >= case.t_ms and case.fits(fits_at), case
            if fits_at > case.t_ms:  # the earliest such instant
                ends = reference.period_ends(case.bucket_ms, case.t_ms, fits_at - 1)
                assert not any(case.fits(at) for at in ends), case


class TestLuaMatchesPython:
    def test_random_cases(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED)
        cases = [random_case(rng) for _ in range(CASES)]
        lua = run_lua(lua_server, cases)
        for case, got in zip(cases, lua, strict=True):
            assert got == case.python(), case

    def test_full_day_windows(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED + 1)
        cases = [dense_day_case(rng) for _ in range(30)] + [sparse_day_case(rng) for _ in range(30)]
        lua = run_lua(lua_server, cases)
        for case, got in zip(cases, lua, strict=True):
            assert got == case.python(), (case.spec, case.t_ms, case.limit, case.amount)


UNPACK_SHIM = STRUCT_SHIM + "return {lua_struct.unpack(ARGV[1], ARGV[2], tonumber(ARGV[3]))}"
UNPACK_REDIS = "return {struct.unpack(ARGV[1], ARGV[2], tonumber(ARGV[3]))}"


def unpack_cases(rng: random.Random) -> list[tuple[str, bytes, int]]:
    """The formats the window decoder uses, at the 2**53 edges and at random, at offsets."""
    edges = [0, 1, -1, 2**53 - 1, -(2**53 - 1), 2**53, 2**53 + 1, 2**62, -(2**62), 2**32, -(2**32)]
    cases = []
    for _ in range(40):
        m = rng.randint(1, 128)
        lead = bytes(rng.randrange(256) for _ in range(rng.randint(0, 5)))

        def i8() -> int:
            return rng.choice(edges) if rng.random() < 0.3 else rng.randint(-(2**62), 2**62)

        header = struct.pack("<BBIqI", rng.randrange(256), 1, rng.randrange(2**32), i8(), m)
        cases.append(("<BBI4i8I4", lead + header, len(lead) + 1))
        cases.append(("<BBI4i8I4i8", lead + header + struct.pack("<q", i8()), len(lead) + 1))
        dense = struct.pack(f"<{m}q", *(i8() for _ in range(m)))
        cases.append(("<" + "i8" * m, lead + dense, len(lead) + 1))
        pairs = [v for _ in range(m) for v in (rng.randrange(2**32), i8())]
        cases.append(("<" + "I4i8" * m, lead + struct.pack("<" + "Iq" * m, *pairs), len(lead) + 1))
        cases.append(
            ("<i4", lead + struct.pack("<i", rng.randint(-(2**31), 2**31 - 1)), len(lead) + 1)
        )
    return cases


def python_unpack(fmt: str, raw: bytes, pos: int) -> list[int]:
    """What Redis answers for ``struct.unpack``: each value as a double, then an integer."""
    py = fmt.replace("i8", "q").replace("I4", "I").replace("i4", "i")
    values = struct.unpack_from(py, raw, pos - 1)
    return [int(float(v)) for v in values] + [pos + struct.calcsize(py)]


class TestStructShim:
    """The embedded run decodes windows with a pure-Lua ``struct.unpack``: it must agree
    with Python's ``struct`` (both backends) and with Redis's own (real Redis)."""

    def test_shim_matches_python_struct(self, lua_server: LuaServer) -> None:
        script = lua_server.client.register_script(UNPACK_SHIM)
        for fmt, raw, pos in unpack_cases(random.Random(SEED)):
            assert script(keys=[], args=[fmt, raw, pos]) == python_unpack(fmt, raw, pos), fmt

    def test_shim_refuses_short_data(self, lua_server: LuaServer) -> None:
        script = lua_server.client.register_script(UNPACK_SHIM)
        with pytest.raises(redis.ResponseError, match="data string too short"):
            script(keys=[], args=["<i8", b"1234567", 1])

    @pytest.mark.integration
    def test_shim_matches_redis_struct(self, redis_sync: redis.Redis) -> None:
        shim = redis_sync.register_script(UNPACK_SHIM)
        real = redis_sync.register_script(UNPACK_REDIS)
        for fmt, raw, pos in unpack_cases(random.Random(SEED + 2)):
            assert shim(keys=[], args=[fmt, raw, pos]) == real(keys=[], args=[fmt, raw, pos])
