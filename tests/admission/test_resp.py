"""The admit path's one-step command packing (admission.resp)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from spendgate.admission import resp
from tests.fixtures.services import Services

ARGS = st.lists(
    st.one_of(st.binary(max_size=40), st.text(max_size=40), st.integers(-(2**63), 2**63 - 1)),
    min_size=1,
    max_size=40,
)


class TestPack:
    @given(args=ARGS)
    def test_the_bytes_are_what_redis_py_sends(self, args: list[bytes | str | int]) -> None:
        command = ["EVALSHA", *args]
        assert resp.pack(command) == b"".join(Connection().pack_command(*command))

    def test_anything_else_is_refused_by_name(self) -> None:
        with pytest.raises(TypeError, match="float"):
            resp.pack(["SET", "k", 1.5])  # type: ignore[list-item]


@pytest.mark.integration
class TestEvalsha:
    async def test_a_script_redis_lost_is_loaded_again(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        script = "return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}"
        sha = redis_client.register_script(script).sha
        await redis_client.script_flush()
        key = f"{key_prefix}k"
        assert await resp.evalsha(redis_client, sha, script, [key], ["é", 41]) == [
            key.encode(),
            "é".encode(),
            42,
        ]
        # Loaded now: the next call needs no load.
        assert await redis_client.script_exists(sha) == [True]

    async def test_an_error_reply_raises_and_the_connection_stays_usable(
        self, redis_client: aioredis.Redis
    ) -> None:
        script = "return redis.error_reply('no budget here')"
        sha = redis_client.register_script(script).sha
        with pytest.raises(ResponseError, match="no budget here"):
            await resp.evalsha(redis_client, sha, script, [], [])
        assert await redis_client.ping()


@pytest.mark.integration
class TestPipelining:
    async def test_commands_handed_over_together_share_one_connection(
        self, redis_client: aioredis.Redis
    ) -> None:
        ids = await asyncio.gather(
            *(resp.execute(redis_client, resp.pack(["CLIENT", "ID"])) for _ in range(8))
        )
        assert len(set(ids)) == 1  # one connection, one write

    async def test_each_caller_gets_its_own_reply_in_order(
        self, redis_client: aioredis.Redis
    ) -> None:
        words = [f"w{i}" for i in range(20)]
        got = await asyncio.gather(
            *(resp.execute(redis_client, resp.pack(["ECHO", w])) for w in words)
        )
        assert got == [w.encode() for w in words]

    async def test_an_error_reply_fails_only_its_own_caller(
        self, redis_client: aioredis.Redis
    ) -> None:
        got = await asyncio.gather(
            resp.execute(redis_client, resp.pack(["ECHO", "a"])),
            resp.execute(redis_client, resp.pack(["NO-SUCH-COMMAND"])),
            resp.execute(redis_client, resp.pack(["ECHO", "b"])),
            return_exceptions=True,
        )
        assert got[0] == b"a" and got[2] == b"b"
        assert isinstance(got[1], ResponseError)
        assert await redis_client.ping()

    async def test_a_caller_that_gave_up_leaves_the_others_their_replies(
        self, redis_client: aioredis.Redis
    ) -> None:
        slow = asyncio.ensure_future(resp.execute(redis_client, resp.pack(["ECHO", "x"])))
        other = asyncio.ensure_future(resp.execute(redis_client, resp.pack(["ECHO", "y"])))
        await asyncio.sleep(0)
        slow.cancel()
        assert await other == b"y"
        assert await resp.execute(redis_client, resp.pack(["ECHO", "z"])) == b"z"

    async def test_an_unreachable_redis_fails_every_caller(self) -> None:
        client = aioredis.Redis.from_url(
            "redis://127.0.0.1:1/0", socket_timeout=0.5, socket_connect_timeout=0.5
        )
        try:
            got = await asyncio.gather(
                *(resp.execute(client, resp.pack(["PING"])) for _ in range(3)),
                return_exceptions=True,
            )
        finally:
            await client.aclose()
        assert all(isinstance(g, RedisConnectionError) for g in got), got

    async def test_a_caller_cancelled_before_the_write_sends_nothing(
        self, redis_client: aioredis.Redis, key_prefix: str
    ) -> None:
        key = f"{key_prefix}cancelled"
        gone = asyncio.ensure_future(resp.execute(redis_client, resp.pack(["INCR", key])))
        await asyncio.sleep(0)  # handed over; the batch goes out on the next turn
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert await resp.execute(redis_client, resp.pack(["ECHO", "after"])) == b"after"
        assert await redis_client.get(key) is None

    async def test_a_connection_lost_mid_batch_fails_only_the_unread_replies(
        self, services: Services, key_prefix: str
    ) -> None:
        # A blocking pop holds its reply past the socket timeout: the read fails there,
        # redis-py drops the connection, and the commands behind it were never read.
        client = aioredis.Redis.from_url(services.redis_url, socket_timeout=0.3)
        try:
            got = await asyncio.gather(
                resp.execute(client, resp.pack(["ECHO", "read"])),
                resp.execute(client, resp.pack(["BLPOP", f"{key_prefix}empty", "2"])),
                resp.execute(client, resp.pack(["ECHO", "unread"])),
                return_exceptions=True,
            )
            assert got[0] == b"read"
            assert all(isinstance(g, RedisTimeoutError) for g in got[1:]), got
            assert await resp.execute(client, resp.pack(["ECHO", "again"])) == b"again"
        finally:
            await client.aclose()
