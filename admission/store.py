"""Redis access for admission: the policies in force and the atomic admit script."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from admission.scripts import ADMIT
from schemas.matching import BudgetTarget
from schemas.policies import Policy
from schemas.redis_keys import (
    pending_key,
    policies_key,
    policies_version_key,
    request_key,
    window_key,
)

#: How long a request id is remembered for idempotent repeats (>= any reservation TTL).
IDEMPOTENCY_TTL_MS = 24 * 3_600_000


@dataclass(frozen=True, slots=True)
class Charge:
    """One budget key to check, with the amount this request would hold on it."""

    target: BudgetTarget
    amount: int


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """What the admit script decided, with each key's used and reserved amounts."""

    replayed: bool
    allowed: bool
    now_ms: int
    retry_after_ms: int | None
    never_fits: bool
    reservation_id: str
    used: tuple[int, ...]
    reserved: tuple[int, ...]


class BudgetStore:
    """The admission side of Redis."""

    def __init__(self, client: aioredis.Redis, prefix: str, refresh_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.refresh_s = refresh_s
        self._admit = client.register_script(ADMIT)
        self._policies: list[Policy] = []
        self._version: bytes | str | None = None
        self._checked = 0.0

    async def policies(self) -> list[Policy]:
        """The policies the stream processor materialized, re-read when they change."""
        if time.monotonic() - self._checked < self.refresh_s:
            return self._policies
        version = await self.client.get(policies_version_key(self.prefix))
        if version != self._version:
            raw = await self.client.hgetall(policies_key(self.prefix))
            self._policies = [Policy.model_validate_json(v) for v in raw.values()]
            self._version = version
        self._checked = time.monotonic()
        return self._policies

    async def admit(
        self, request_id: str, reservation_id: str, charges: list[Charge]
    ) -> AdmitResult:
        """Check every charge and reserve on all of them, or on none, in one script."""
        keys = [request_key(self.prefix, request_id)]
        args: list[int | str] = [len(charges), reservation_id, IDEMPOTENCY_TTL_MS]
        for charge in charges:
            policy = charge.target.policy
            keys += [
                window_key(self.prefix, charge.target.key),
                pending_key(self.prefix, charge.target.key),
            ]
            args += [
                policy.limit,
                policy.window_ms,
                policy.bucket_ms,
                policy.boundary,
                charge.amount,
                policy.reservation_ttl_ms,
            ]
        raw = await self._admit(keys=keys, args=args)
        replayed, allowed, now_ms, retry, rid, *rest = raw
        retry = int(retry)
        return AdmitResult(
            replayed=bool(int(replayed)),
            allowed=bool(int(allowed)),
            now_ms=int(now_ms),
            retry_after_ms=retry if retry >= 0 else None,
            never_fits=retry == -2,
            reservation_id=rid.decode() if isinstance(rid, bytes) else str(rid),
            used=tuple(int(v) for v in rest[0::2]),
            reserved=tuple(int(v) for v in rest[1::2]),
        )

    async def ping(self) -> bool:
        """True when Redis answers."""
        return bool(await self.client.ping())
