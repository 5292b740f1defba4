"""The admit path's one-step command packing (admission.resp)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.exceptions import ResponseError

from spendgate.admission import resp

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
