"""Read whether the stack can decide, from Redis: the answer of ``GET /v1/status``.

One ``MULTI``/``EXEC`` reads the Redis clock (``TIME``), the topology, the marks, their
progress and their owners' fencing tokens, so the classification
(:func:`schemas.status.classify`, the admit script's) sees one instant. The same code
serves the route, ``spendgate dev status``, the demo and the tests (no HTTP needed):
:func:`read_status` on an asyncio client, :func:`read_status_sync` on a blocking one.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from spendgate.schemas.redis_keys import (
    mark_owners_key,
    mark_progress_key,
    marks_key,
    policies_key,
    topology_key,
)
from spendgate.schemas.shards import Topology
from spendgate.schemas.status import MarkState, PartitionStatus, StackStatus, WorkerLag, classify

__all__ = [
    "MarkState",
    "PartitionStatus",
    "StackStatus",
    "WorkerLag",
    "read_status",
    "read_status_sync",
]


def _queue_keys(prefix: str) -> list[Any]:
    """The reads after the clock, each a function of a pipeline."""
    return [
        lambda pipe: pipe.get(topology_key(prefix)),
        lambda pipe: pipe.hgetall(marks_key(prefix)),
        lambda pipe: pipe.hgetall(mark_progress_key(prefix)),
        lambda pipe: pipe.hgetall(mark_owners_key(prefix)),
        lambda pipe: pipe.hlen(policies_key(prefix)),
    ]


def _queue(pipe: Any, prefix: str) -> None:
    pipe.time()
    for queued in _queue_keys(prefix):
        queued(pipe)


def _text_keys(raw: dict[Any, Any]) -> dict[str, bytes | str]:
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}


def _decode(replies: list[Any], staleness_ms: int) -> StackStatus:
    clock, topology, marks, progress, owners, policies = replies
    seconds, micros = clock
    # As the admit script: seconds * 1000 + floor(micros / 1000).
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    return classify(
        now_ms=now_ms,
        staleness_ms=staleness_ms,
        topology=Topology.decode(topology) if topology is not None else None,
        marks=_text_keys(marks),
        progress=_text_keys(progress),
        owners=_text_keys(owners),
        policies=int(policies),
    )


async def read_status(client: aioredis.Redis, prefix: str, staleness_ms: int) -> StackStatus:
    """Every partition mark of ``prefix``'s topology, classified as the admit script does.

    Raises:
        redis.RedisError: Redis does not answer (the caller decides what that means).
    """
    if isinstance(client, RedisCluster):
        return await _read_cluster(client, prefix, staleness_ms)
    async with client.pipeline(transaction=True) as pipe:
        _queue(pipe, prefix)
        replies = await pipe.execute()
    return _decode(replies, staleness_ms)


async def _read_cluster(client: RedisCluster, prefix: str, staleness_ms: int) -> StackStatus:
    """On a cluster, ``prefix`` is the control shard's (its copy of every mark): the clock
    of the node holding it, then its keys in one pipeline (no transaction spans a node's
    clock and its keys there; the marks may be a moment newer than the clock, never older
    than what an admit there saw)."""
    node = client.get_node_from_key(marks_key(prefix))
    clock = await client.time(target_nodes=node)
    pipe = client.pipeline()
    for queued in _queue_keys(prefix):
        queued(pipe)
    replies = await pipe.execute()
    return _decode([clock, *replies], staleness_ms)


def read_status_sync(client: redis.Redis, prefix: str, staleness_ms: int) -> StackStatus:
    """:func:`read_status` on a blocking client."""
    with client.pipeline(transaction=True) as pipe:
        _queue(pipe, prefix)
        replies = pipe.execute()
    return _decode(replies, staleness_ms)
