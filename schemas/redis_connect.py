"""The asyncio Redis client of a service: one Redis, or a Redis Cluster (redis-py's cluster
client, which routes every command by its key's slot and follows failovers)."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from spendgate.schemas.layout import Layout

__all__ = ["async_client", "layout_of"]


def async_client(url: str, cluster: bool, **options: Any) -> aioredis.Redis:
    """A client for ``url``: any node of the cluster when ``cluster`` (typed as a plain
    client: the commands spendgate sends exist on both)."""
    if cluster:
        return RedisCluster.from_url(url, **options)  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, **options)


def layout_of(prefix: str, cluster: bool) -> Layout:
    """The key layout of a deployment (``schemas.layout``)."""
    return Layout(prefix, cluster=cluster)
