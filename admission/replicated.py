"""A script call on a Redis Cluster that answers only once a replica holds its writes.

A cluster replicates asynchronously: a master that dies right after a script reserved can
be replaced by a replica that never saw the reservation, while its windows and marks look
present, so an answered reservation would be lost and its room given twice. Every step
that may hold is therefore sent with ``WAIT <replicas> <ms>`` right behind it, on the same
connection of the slot's master (WAIT counts the replicas that acknowledged *this
connection's* writes, so it must share the script's connection; redis-py would send it to
every master). Fewer replicas acknowledging in time is a store failure
(:class:`ReplicaLag`): the caller answers by the policy's failure mode, as when the shard
is unreachable, and whatever the step held stays held until it is released, absorbed or
ages out (never less than the truth).

A redirect (``MOVED``/``ASK``: the slot's master changed in a failover), ``CLUSTERDOWN``,
``TRYAGAIN`` or a lost connection refreshes the client's view of the cluster and is a
store failure for this one call; the next one goes to the new master.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from spendgate.schemas.backoff import connection_lost
from spendgate.schemas.luascript import LuaScript

__all__ = ["ReplicaLag", "run_replicated"]


class ReplicaLag(RedisConnectionError):
    """Fewer replicas than required acknowledged a step's writes in time (a store failure:
    a failover now could lose them)."""


async def run_replicated(
    client: RedisCluster,
    script: LuaScript,
    keys: Sequence[str],
    args: Sequence[bytes | str | int],
    *,
    replicas: int,
    timeout_ms: int,
) -> Any:
    """Run ``script`` on the master of ``keys``' slot, then WAIT on the same connection.

    Raises:
        ReplicaLag: fewer than ``replicas`` acknowledged within ``timeout_ms``.
        redis.ConnectionError: the master is unreachable or no longer owns the slot.
        redis.ResponseError: the script failed.
    """
    node = client.get_node_from_key(keys[0])
    if node is None:
        raise RedisConnectionError(f"no master owns the slot of {keys[0]!r} now")
    for name, body in (("EVALSHA", script.sha), ("EVAL", script.source)):
        calls = [
            PipelineCommand(0, name, body, len(keys), *keys, *args),
            PipelineCommand(1, "WAIT", replicas, timeout_ms),
        ]
        try:
            await node.execute_pipeline(calls)
        except (RedisConnectionError, OSError, AttributeError, TypeError, RuntimeError) as exc:
            if not isinstance(exc, RedisConnectionError | OSError) and not connection_lost(exc):
                raise
            await _refresh(client)
            raise RedisConnectionError(f"cluster node {node.name} failed: {exc!r}") from exc
        reply, acked = calls[0].result, calls[1].result
        if isinstance(reply, NoScriptError) and name == "EVALSHA":
            continue
        if isinstance(reply, _NOT_HERE):
            # redis-py strips the code from the message: told apart by type.
            await _refresh(client)
            raise RedisConnectionError(
                f"{node.name} cannot serve the slot now ({type(reply).__name__}: {reply})"
            )
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(acked, BaseException):
            raise RedisConnectionError(f"WAIT failed on {node.name}: {acked}")
        if int(acked) < replicas:
            raise ReplicaLag(
                f"{int(acked)} of {replicas} replicas of {node.name} acknowledged within "
                f"{timeout_ms} ms: the step is not answered as durable"
            )
        return reply
    raise AssertionError("unreachable: EVAL never answers NOSCRIPT")


#: A node that no longer (or not yet) serves the slot: redirected, or mid-failover.
_NOT_HERE = (AskError, ClusterDownError, TryAgainError)
_refreshing: dict[int, asyncio.Lock] = {}


async def _refresh(client: RedisCluster) -> None:
    """Re-read the cluster's slots (after a failover), once for every call that failed
    meanwhile; a failure is left to the next call."""
    lock = _refreshing.setdefault(id(client), asyncio.Lock())
    if lock.locked():
        async with lock:
            return
    async with lock:
        with contextlib.suppress(RedisConnectionError, OSError, ResponseError):
            await client.nodes_manager.initialize()
