"""``spendgate budgets``: the budgets nearest their limits, read from Redis (nothing written)."""

from __future__ import annotations

from collections.abc import Sequence

from spendgate.dashboard.reader import BudgetReader
from spendgate.dashboard.views import KeyRow
from spendgate.schemas.matching import parse_key
from spendgate.schemas.redis_connect import (
    RedisConnection,
    RedisSettings,
    async_client,
    check,
    layout_of,
)

__all__ = ["top_budgets"]

#: Index pages read while a subject filter thins them out.
_PAGE = 200


def _matches(key: str, subject: dict[str, str]) -> bool:
    """Whether every ``field=value`` of ``subject`` is one of the key's ``group_by`` values."""
    _, fields = parse_key(key)
    return all(fields.get(name) == value for name, value in subject.items())


async def top_budgets(
    redis: RedisConnection | str,
    prefix: str,
    *,
    top: int,
    tenant: str | None = None,
    policy: str | None = None,
    subject: Sequence[tuple[str, str]] = (),
    cluster: bool = False,
) -> list[KeyRow]:
    """The ``top`` budgets by utilization (used + reserved over limit), highest first.

    Candidates come from the worker's utilization index (``schemas.redis_keys.
    utilization_key``) in its order, so only the rows shown are decoded; ``tenant`` and
    ``policy`` filter on the index's names, ``subject`` (``field=value`` pairs) on the
    keys' ``group_by`` values.

    ``redis``: the connection (``WorkerSettings.redis()``). A URL string is still taken
    (the ``budgets`` command passes one today): the other ``SPENDGATE_REDIS_*`` settings
    of the environment (user, password, TLS) then apply to it, and ``cluster`` says it
    names a Redis Cluster node.
    """
    if isinstance(redis, str):
        redis = RedisSettings(redis_url=redis, redis_cluster=cluster).redis()
    client = async_client(redis)
    try:
        await check(client, redis)
        reader = BudgetReader(client, prefix, layout_of(prefix, redis.cluster))
        wanted = dict(subject)
        rows: list[KeyRow] = []
        offset = 0
        while len(rows) < top:
            page = await reader.page(
                lambda _tenant: True,
                tenant=tenant,
                policy=policy,
                offset=offset,
                limit=_PAGE if wanted else top,
            )
            rows += [r for r in page.rows if _matches(r.key, wanted)]
            offset += _PAGE if wanted else top
            if offset >= page.matched:
                break
        rows.sort(key=lambda r: r.share, reverse=True)
        return rows[:top]
    finally:
        await client.aclose()
