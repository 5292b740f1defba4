"""Write what admission needs into Redis: bucket amounts, absorbed reservations, policies."""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from schemas import window_codec
from schemas.policies import Policy
from schemas.redis_keys import pending_key, policies_key, policies_version_key, window_key
from schemas.windows import WindowSpec
from streams.ledger import Change, KeyState


class RedisMaterializer:
    """Applies each state change to Redis in one MULTI/EXEC transaction."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    async def write(self, key: str, state: KeyState, change: Change, spec: WindowSpec) -> None:
        """Mirror ``change`` of ``key``; absorbing a pending reservation in the same step.

        The window is stored as the compact codec value the admission script decodes.
        """
        if not (change.buckets_changed or change.absorbed):
            return
        async with self.client.pipeline(transaction=True) as pipe:
            if change.buckets_changed:
                pipe.set(
                    window_key(self.prefix, key),
                    window_codec.encode(state.buckets, spec.bucket_ms),
                    # Idle longer than this, every bucket has aged out of the window.
                    px=2 * spec.window_ms,
                )
            if change.absorbed:
                pipe.hdel(pending_key(self.prefix, key), change.absorbed)
            await pipe.execute()

    async def restore(self, key: str, state: KeyState) -> None:
        """Rewrite one key's window from its table state (after Redis lost its data)."""
        if not (state.bucket_ms and state.window_ms):
            return
        await self.client.set(
            window_key(self.prefix, key),
            window_codec.encode(state.buckets, state.bucket_ms),
            px=2 * state.window_ms,
        )

    async def write_policies(self, policies: Iterable[Policy]) -> None:
        """Replace the policies hash with ``policies``."""
        pkey = policies_key(self.prefix)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(pkey)
            for policy in policies:
                pipe.hset(pkey, policy.id, policy.model_dump_json())
            pipe.incr(policies_version_key(self.prefix))
            await pipe.execute()
