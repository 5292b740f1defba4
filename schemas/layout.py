"""Where each Redis key lives: one Redis (the layout as it always was) or a Redis Cluster.

On a cluster every key a script touches must hash to one slot, so keys are grouped into
:data:`VIRTUAL_SHARDS` virtual shards, each a hash tag ``{sN}`` right after the prefix:
a *shard prefix* such as ``sg:{s7}``, which the names of ``schemas.redis_keys`` are then
built on (``window_key("sg:{s7}", key)`` is ``sg:{s7}w:<key>``). A fixed, small set of
tags, never tenant ids, keeps the per-shard bookkeeping (marks, unpublished reserves,
stored answers) bounded however many tenants there are.

A budget key lives in its tenant's shard when its policy is tenant-scoped
(``schemas.shards.tenant_scoped``: grouped by tenant, or matching one tenant exactly),
else in its own key's shard, the grouping the worker partitions by: a tenant's usual
request touches only its *home shard*. Budget keys escape braces
(``schemas.matching.budget_key``), so no value can add a tag of its own.

Without a cluster every shard prefix is the prefix itself: the names stay those of a
single Redis and an existing deployment needs no migration.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from spendgate.schemas.matching import parse_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.shards import tenant_of, tenant_scoped

#: Virtual shards of a cluster layout (tags ``{s0}`` .. ``{s63}``).
VIRTUAL_SHARDS = 64
_RESERVATION = re.compile(r"s(\d{1,2})-")


def shard_of(name: str) -> int:
    """The virtual shard of a tenant id or a budget key (CRC-32, stable everywhere)."""
    return zlib.crc32(name.encode()) % VIRTUAL_SHARDS


@dataclass(frozen=True, slots=True)
class Layout:
    """The shard prefixes of one deployment.

    Args:
        prefix: ``SPENDGATE_REDIS_PREFIX``.
        cluster: whether Redis is a cluster (keys tagged by virtual shard).
    """

    prefix: str
    cluster: bool = False

    def shard(self, n: int) -> str:
        """The prefix of virtual shard ``n`` (the prefix itself without a cluster)."""
        if not 0 <= n < VIRTUAL_SHARDS:
            raise ValueError(f"virtual shard {n} is not in 0..{VIRTUAL_SHARDS - 1}")
        return f"{self.prefix}{{s{n}}}" if self.cluster else self.prefix

    def shards(self) -> tuple[str, ...]:
        """Every shard prefix, in shard order (one without a cluster)."""
        if not self.cluster:
            return (self.prefix,)
        return tuple(self.shard(n) for n in range(VIRTUAL_SHARDS))

    @property
    def control(self) -> str:
        """The prefix of the keys every process reads and no script reads with a budget
        key: the policies, their version, the topology (shard 0 on a cluster)."""
        return self.shard(0)

    def home_shard(self, tenant: str | None) -> int:
        """The shard of a tenant's bookkeeping (stored answers, reservation records)."""
        return shard_of(tenant or "")

    def key_shard(self, policy: Policy, key: str) -> int:
        """The shard of budget key ``key`` of ``policy``."""
        if tenant_scoped(policy):
            tenant = tenant_of(policy, parse_key(key)[1])
            if tenant is not None:
                return self.home_shard(tenant)
        return shard_of(key)

    def of_key(self, policy: Policy, key: str) -> str:
        """The shard prefix the windows of budget key ``key`` of ``policy`` live under."""
        return self.shard(self.key_shard(policy, key)) if self.cluster else self.prefix

    def reservation_id(self, home: int, unique: str) -> str:
        """A reservation id that names its home shard (``s7-<unique>``; ``unique``
        without a cluster), so commit, release and extend find its record from the id."""
        return f"s{home}-{unique}" if self.cluster else unique

    def of_reservation(self, reservation_id: str) -> str:
        """The shard prefix of a reservation's record.

        Raises:
            ValueError: on a cluster, an id that names no shard (not made by
                :meth:`reservation_id`).
        """
        if not self.cluster:
            return self.prefix
        found = _RESERVATION.match(reservation_id)
        if found is None or int(found.group(1)) >= VIRTUAL_SHARDS:
            raise ValueError(f"reservation id {reservation_id!r} names no shard")
        return self.shard(int(found.group(1)))
