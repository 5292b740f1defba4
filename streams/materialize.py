"""Write what admission needs into Redis: bucket amounts, absorbed reservations, policies."""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from schemas.policies import Policy
from schemas.redis_keys import pending_key, policies_key, policies_version_key, window_key
from streams.ledger import Change, KeyState


class RedisMaterializer:
    """Applies each state change to Redis in one MULTI/EXEC transaction."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    async def write(self, key: str, state: KeyState, change: Change, window_ms: int) -> None:
        """Mirror ``change`` of ``key``; absorbing a pending reservation in the same step."""
        if not (change.touched or change.dropped or change.absorbed):
            return
        wkey = window_key(self.prefix, key)
        async with self.client.pipeline(transaction=True) as pipe:
            for bucket in change.touched:
                amount = state.buckets.get(bucket, 0)
                if amount:
                    pipe.hset(wkey, str(bucket), amount)
                else:
                    pipe.hdel(wkey, str(bucket))
            if change.dropped:
                pipe.hdel(wkey, *(str(b) for b in change.dropped))
            if change.absorbed:
                pipe.hdel(pending_key(self.prefix, key), change.absorbed)
            pipe.pexpire(wkey, 2 * window_ms)
            await pipe.execute()

    async def write_policies(self, policies: Iterable[Policy]) -> None:
        """Replace the policies hash with ``policies``."""
        pkey = policies_key(self.prefix)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(pkey)
            for policy in policies:
                pipe.hset(pkey, policy.id, policy.model_dump_json())
            pipe.incr(policies_version_key(self.prefix))
            await pipe.execute()
