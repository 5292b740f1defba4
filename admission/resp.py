"""One Redis command packed in one step (RESP), sent on a pooled redis-py connection.

The admit path's single script call carries 20-60 arguments; redis-py's generic packer
checks and encodes each of them with several calls, which was a third of the Python time
of a call (bench/RESULTS.md). :func:`pack` builds the same bytes with one join, and
:func:`execute` sends them on a connection of the client's own pool (its timeouts, its
disconnect-on-error: a connection that failed mid-reply is never reused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

__all__ = ["Packed", "evalsha", "execute", "pack"]

Packed = bytes
Arg = bytes | str | int


def pack(args: Sequence[Arg]) -> Packed:
    """The RESP array of bulk strings for one command (what redis-py sends for it)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if type(arg) is str:
            data = arg.encode()
        elif type(arg) is int:
            data = b"%d" % arg
        elif type(arg) is bytes:
            data = arg
        else:
            raise TypeError(f"a Redis argument must be bytes, str or int, not {type(arg)}")
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


async def execute(client: aioredis.Redis, packed: Packed) -> Any:
    """Send one packed command and read its reply (error replies raise, as in redis-py)."""
    pool = client.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        # Both disconnect the connection when they fail for any reason but an error reply.
        await conn.send_packed_command(packed)
        return await conn.read_response()
    finally:
        await pool.release(conn)


async def evalsha(
    client: aioredis.Redis, sha: str, script: str, keys: Sequence[Arg], args: Sequence[Arg]
) -> Any:
    """``EVALSHA`` packed in one step; the script is loaded once if Redis lacks it."""
    packed = pack(["EVALSHA", sha, len(keys), *keys, *args])
    try:
        return await execute(client, packed)
    except NoScriptError:
        await client.script_load(script)
        return await execute(client, packed)
