"""The EXTEND script on its own: embedded (no server) and on the real Redis."""

from __future__ import annotations

from spendgate.admission.scripts.extend import SCRIPT, ExtendArgs, ExtendTarget
from spendgate.schemas import window_codec
from spendgate.schemas.redis_keys import (
    extend_key,
    held_keys,
    marks_key,
    pending_reservations_key,
    reservation_key,
    window_key,
)
from tests.fixtures import held
from tests.fixtures.embedded_lua import LuaServer

BUCKET = 5_000
WINDOW = 60_000
#: Reply entries per target (the layout in admission/scripts/extend.lua).
PER_TARGET = 6


def call(
    lua: LuaServer,
    seq: int,
    targets: list[tuple[str, int, int]],
    *,
    rid: str = "r1",
    marks: tuple[str, ...] = ("m0",),
    deps: str = "1",
    failure: int = 0,
) -> list[int]:
    """Run EXTEND for ``targets`` = (budget key, limit, amount); the reply as ints."""
    p = lua.prefix
    extend = ExtendArgs(
        answer_key=extend_key(p, rid, seq),
        record_key=reservation_key(p, rid),
        marks_key=marks_key(p),
        entry=f"extend-{seq}-{rid}",
        answer_ttl_ms=60_000,
        staleness_ms=30_000,
        marks=marks,
        targets=tuple(
            ExtendTarget(
                held_keys(p, key),
                limit=limit,
                window_ms=WINDOW,
                bucket_ms=BUCKET,
                boundary="include",
                amount=amount,
                observe=False,
                failure=failure,
                deps=deps,
                reservation_ttl_ms=900_000,
            )
            for key, limit, amount in targets
        ),
    )
    reply = lua.script(SCRIPT.source)(keys=extend.keys(), args=extend.argv())
    return [int(v) for v in reply]


def open_reservation(lua: LuaServer, rid: str = "r1") -> None:
    lua.client.hset(reservation_key(lua.prefix, rid), mapping={"subject": "{}", "plan": 1})
    lua.client.hset(marks_key(lua.prefix), "m0", 2**52)


def pending(lua: LuaServer, key: str) -> int:
    return held.pending_sum(lua.client, lua.prefix, key)


class TestExtendScript:
    def test_grows_every_key_in_the_bucket_of_now(self, lua_server: LuaServer) -> None:
        open_reservation(lua_server)
        lua_server.client.set(
            window_key(lua_server.prefix, "a"), window_codec.encode({0: 7}, BUCKET)
        )
        reply = call(lua_server, 1, [("a", 100, 30), ("b", 100, 40)])
        replayed, outcome, now, n, *rest = reply
        assert (replayed, outcome, n) == (0, 1, 2)
        assert rest[0:4] == [0, 0, 30, 0]  # key a: the old bucket aged out long ago
        assert len(rest) == 2 * PER_TARGET
        assert (pending(lua_server, "a"), pending(lua_server, "b")) == (30, 40)
        field = now - now % BUCKET + BUCKET - 1
        # Key a's window is a version-2 value: its worker absorbs version 2, so the extend
        # is held there, its entry in that hash under "r:" + the entry's name; key b has no
        # window yet: version 1, its entry in the pending reservations.
        p = lua_server.prefix
        assert not lua_server.client.exists(pending_reservations_key(p, "a"))
        entries_b = lua_server.client.hgetall(pending_reservations_key(p, "b"))
        assert entries_b == {b"extend-1-r1": f"{field}:40".encode()}
        assert lua_server.client.hgetall(f"{p}pv:a") == {
            str(field).encode(): b"30",
            b"t": b"30",
            b"r:extend-1-r1": f"{field}:30".encode(),
            b"h": str(field).encode(),
            b"n": str(field).encode(),
        }
        assert lua_server.client.lrange(f"{p}pq:a", 0, -1) == [str(field).encode()]
        assert lua_server.client.hgetall(f"{p}pw:b") == {str(field).encode(): b"40"}
        assert not lua_server.client.exists(f"{p}pw:a", f"{p}pv:b")

    def test_refuses_on_every_key_when_one_is_full(self, lua_server: LuaServer) -> None:
        open_reservation(lua_server)
        assert call(lua_server, 1, [("a", 100, 90)])[1] == 1
        reply = call(lua_server, 2, [("b", 1000, 5), ("a", 100, 20)])
        assert reply[1] == 0
        per = PER_TARGET
        assert reply[4 + 3] == 0 and reply[4 + per + 3] == 1  # only key a violated
        assert (pending(lua_server, "a"), pending(lua_server, "b")) == (90, 0)

    def test_a_repeated_sequence_number_returns_the_first_answer(
        self, lua_server: LuaServer
    ) -> None:
        open_reservation(lua_server)
        first = call(lua_server, 1, [("a", 100, 30)])
        again = call(lua_server, 1, [("a", 100, 30)])
        assert again[0] == 1 and again[1:] == first[1:]
        assert pending(lua_server, "a") == 30

    def test_missing_settled_and_unvouched(self, lua_server: LuaServer) -> None:
        assert call(lua_server, 1, [("a", 100, 1)])[1] == 6
        open_reservation(lua_server)
        lua_server.client.hdel(marks_key(lua_server.prefix), "m0")
        assert call(lua_server, 1, [("a", 100, 1)])[1] == 5
        assert call(lua_server, 1, [("a", 100, 1)], failure=1)[1] == 1  # fails open
        lua_server.client.hset(reservation_key(lua_server.prefix, "r1"), "settled", "commit")
        assert call(lua_server, 2, [("a", 100, 1)])[1] == 7
        assert pending(lua_server, "a") == 1
