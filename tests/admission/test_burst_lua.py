"""The Lua token bucket against the Python engine (``schemas/burst.py``), in a real Redis and
embedded; the engine itself is judged by a brute force in
``tests/schemas/test_burst_properties.py``."""

from __future__ import annotations

import random

from spendgate.schemas.burst import BurstSpec, BurstState, check, decode_state, encode_state, take
from spendgate.schemas.luascript import text_of
from tests.fixtures.embedded_lua import LuaServer, harness
from tests.fixtures.seeds import derive

BURST_LUA_LIB = text_of("spendgate.schemas", "burst")
BURST_CHECK_SCRIPT = harness("burst_check")

SEED = derive("test_burst_lua")
CASES = 3_000


def random_case(rng: random.Random) -> tuple[BurstSpec, BurstState | None, int, int]:
    """Small buckets mostly; sometimes the largest exact scale and epoch-scale times."""
    if rng.random() < 0.7:
        spec = BurstSpec(rng.randint(1, 50), rng.randint(1, 5000), rng.randint(1, 200))
    else:
        per = rng.choice([1, 1000, 60_000, 3_600_000, 86_400_000])
        spec = BurstSpec(rng.randint(1, 2**40), per, rng.randint(1, (2**53 - 1) // per))
    now = rng.randrange(0, 2**42)
    state = None
    if rng.random() < 0.85:
        state = BurstState(rng.randint(0, spec.full), now - rng.randint(-1000, 10 * spec.per_ms))
    amount = rng.choice([0, 1, spec.capacity, spec.capacity + 1, rng.randint(0, spec.capacity)])
    return spec, state, now, amount


class TestBurstLua:
    def test_lib_reads_no_keys_or_argv(self) -> None:
        assert "KEYS" not in BURST_LUA_LIB
        assert "ARGV" not in BURST_LUA_LIB

    def test_lua_is_the_python_engine(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED)
        script = lua_server.script(BURST_CHECK_SCRIPT)
        cases = [random_case(rng) for _ in range(CASES)]
        pipe = lua_server.client.pipeline(transaction=False)
        for i, (spec, state, now, amount) in enumerate(cases):
            key = f"{lua_server.prefix}bt{i}"
            if state is None:
                pipe.delete(key)
            else:
                pipe.set(key, encode_state(state))
            script(keys=[key], args=[spec.encode(), now, amount], client=pipe)
        replies = [r for r in pipe.execute() if isinstance(r, list)]
        for (spec, state, now, amount), reply in zip(cases, replies, strict=True):
            stored = decode_state(encode_state(state)) if state is not None else None
            got = check(spec, stored, now, amount)
            after = take(spec, got.level, now, amount)
            ttl = -(-(spec.full - after.level) // spec.rate)
            want = [got.level, int(got.fits), got.wait_ms, int(got.never_fits), after.level, ttl]
            assert reply == want, (spec, state, now, amount)
