"""Check at startup that Redis keeps what admission writes: persistence on, no eviction."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

_SETTINGS = ("appendonly", "appendfsync", "save", "maxmemory-policy")


def durability_problems(config: dict[str, str]) -> list[str]:
    """What in a Redis configuration (``CONFIG GET`` values) can lose admission's writes.

    Reservations pending in Redis and the windows between two worker writes exist only
    there, so Redis must persist every second (AOF) and never evict them.
    """
    problems = []
    if config.get("appendonly", "no") != "yes":
        snapshots = "RDB snapshots only" if config.get("save") else "no persistence at all"
        problems.append(
            f"appendonly is off ({snapshots}): a Redis restart loses pending reservations; "
            "run Redis with appendonly yes and appendfsync everysec"
        )
    elif config.get("appendfsync") == "no":
        problems.append("appendfsync is 'no': use everysec so at most one second is lost")
    policy = config.get("maxmemory-policy", "noeviction")
    if policy != "noeviction":
        problems.append(
            f"maxmemory-policy is {policy!r}: Redis may evict windows and reservations "
            "under memory pressure; use noeviction (admission then fails by policy instead)"
        )
    return problems


async def warn_if_not_durable(client: aioredis.Redis) -> list[str]:
    """Log a warning per durability problem of the Redis behind ``client``.

    ``CONFIG`` may be disabled or renamed (managed Redis): then nothing can be checked
    and one INFO line says so. Never raises: the check must not stop the service.

    Returns:
        The problems found (empty when fine or when nothing could be checked).
    """
    config: dict[str, str] = {}
    try:
        for name in _SETTINGS:
            found = await client.config_get(name)
            config.update({_text(k): _text(v) for k, v in found.items()})
    except ResponseError as exc:
        logger.info("cannot check Redis persistence (CONFIG refused: %s)", exc)
        return []
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        logger.warning("cannot check Redis persistence now (Redis unreachable: %s)", exc)
        return []
    problems = durability_problems(config)
    for problem in problems:
        logger.warning("Redis durability: %s", problem)
    return problems


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value
