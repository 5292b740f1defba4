"""Redis commands packed in one step (RESP), pipelined on the client's own pool.

The admit path's single script call carries 20-60 arguments; redis-py's generic packer
checks and encodes each of them with several calls, which was a third of the Python time
of a call (bench/RESULTS.md). :func:`pack` builds the same bytes with one join.
:func:`execute` sends them on a connection of the client's own pool (its timeouts, its
disconnect-on-error: a connection that failed mid-reply is never reused); the commands
callers hand it within one turn of the event loop go out together, in one write on one
connection, and their replies are read back in order (what redis-py's pipeline does for
one caller, here for concurrent ones): one socket write, one read wake-up and one pool
checkout per batch instead of per command. Each caller gets its own reply or its own
error reply; a failure of the connection fails the commands whose replies it had not
read yet.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

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


_Batch = list[tuple[bytes, "asyncio.Future[Any]"]]


def _settle(batch: _Batch, exc: BaseException) -> None:
    # A cancellation of the sender (the loop shutting down) cancels its callers; any other
    # failure is each caller's own error.
    for _, future in batch:
        if future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)


def _live(batch: _Batch) -> _Batch:
    """The commands whose callers still wait: a caller cancelled before the write sends
    nothing (as an unpipelined call cancelled before its send)."""
    return [item for item in batch if not item[1].done()]


class _Pipe:
    """The commands handed to one client within one turn of one event loop."""

    def __init__(self, client: aioredis.Redis, loop: asyncio.AbstractEventLoop) -> None:
        # The pool, not the client: the client is this pipe's key in a weak mapping.
        self.pool = client.connection_pool
        self.loop = loop
        self.queue: _Batch = []
        self.running: set[asyncio.Task[None]] = set()

    def submit(self, packed: Packed) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self.loop.create_future()
        if not self.queue:
            self.loop.call_soon(self._flush)
        self.queue.append((packed, future))
        return future

    def _flush(self) -> None:
        batch, self.queue = self.queue, []
        task = self.loop.create_task(self._send(batch))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _send(self, batch: _Batch) -> None:
        # Every failure reaches the callers through their futures; only a cancellation
        # (the loop shutting down) propagates from this task.
        batch = _live(batch)
        if not batch:
            return
        pool = self.pool
        try:
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        except BaseException as exc:
            _settle(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        try:
            batch = _live(batch)
            if batch:
                await self._exchange(conn, batch)
        finally:
            await pool.release(conn)

    @staticmethod
    async def _exchange(conn: Any, batch: _Batch) -> None:
        try:
            # Both disconnect the connection when they fail for any reason but an error
            # reply.
            await conn.send_packed_command([packed for packed, _ in batch])
            for i, (_, future) in enumerate(batch):
                try:
                    reply = await conn.read_response()
                except ResponseError as exc:  # this command's own error reply
                    if not future.done():
                        future.set_exception(exc)
                    continue
                except BaseException:
                    batch = batch[i:]
                    raise
                if not future.done():
                    future.set_result(reply)
        except BaseException as exc:
            _settle(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise


_pipes: weakref.WeakKeyDictionary[aioredis.Redis, _Pipe] = weakref.WeakKeyDictionary()


async def execute(client: aioredis.Redis, packed: Packed) -> Any:
    """Send one packed command and read its reply (error replies raise, as in redis-py);
    sent in one write with the others handed over in the same turn of the event loop."""
    loop = asyncio.get_running_loop()
    pipe = _pipes.get(client)
    if pipe is None or pipe.loop is not loop:
        pipe = _pipes[client] = _Pipe(client, loop)
    return await pipe.submit(packed)


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
