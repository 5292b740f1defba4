"""Redis access for admission: the policies in force and the atomic admit/settle scripts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from admission.backpressure import Backpressure
from admission.exceptions import Overloaded, StoreUnavailable
from admission.metrics import OVERLOADED, STORE_FAILURES
from admission.scripts import ADMIT, ADMIT_REPLY_PER_TARGET, SETTLE, AdmitHeader, AdmitTarget
from schemas.events import Subject, Usage, partition_key
from schemas.matching import BudgetTarget
from schemas.policies import Policy
from schemas.redis_keys import (
    marks_key,
    pending_reservations_key,
    pending_window_key,
    policies_key,
    policies_version_key,
    request_key,
    reservation_key,
    topology_key,
    unpublished_reserves_key,
    window_key,
)
from schemas.shards import Topology

logger = logging.getLogger(__name__)

#: How long a request id is remembered for idempotent repeats (>= any reservation TTL).
IDEMPOTENCY_TTL_MS = 24 * 3_600_000
#: A reservation record outlives its longest TTL by this, so a late commit still finds it.
RECORD_GRACE_MS = 3_600_000

Outcome = Literal["reject", "allow", "cap", "observe_reject", "unvouched"]
#: The script's outcome codes (4, "try downgrade", never leaves the script).
_OUTCOMES: dict[int, Outcome] = {
    0: "reject",
    1: "allow",
    2: "cap",
    3: "observe_reject",
    5: "unvouched",
}
_ON_EXCEED = {"reject": 0, "cap": 1, "downgrade": 2}
_FAILURE = {"closed": 0, "open": 1, "degraded": 2}
#: Whether Redis holds a window the worker vouches for (see ``schemas.shards``).
State = Literal["vouched", "stale", "missing"]
_STATES: tuple[State, ...] = ("vouched", "stale", "missing")
#: A mark field no worker writes: without a topology every window counts as missing.
_NO_TOPOLOGY = "topology-unknown"
_STORE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CapTerms:
    """How a key's amount depends on the output tokens ``o``: ``ceil((s + o*r) / d)``.

    ``r == 0`` means capping output cannot lower this key's amount.
    """

    s: int = 0
    r: int = 0
    d: int = 1


@dataclass(frozen=True, slots=True)
class Charge:
    """One budget key to check, with the amount this request would hold on it.

    ``alt`` is the index (0-based, > 0) of the plan to try when this key refuses and
    its policy downgrades; 0 for none.
    """

    target: BudgetTarget
    amount: int
    cap: CapTerms = CapTerms()
    alt: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """The request for one subject (the original, or with a downgraded model)."""

    subject: Subject
    charges: tuple[Charge, ...]


@dataclass(frozen=True, slots=True)
class KeyState:
    """One key as the decision saw it."""

    used: int
    reserved: int
    own: int
    violated: bool
    reset_after_ms: int
    state: State = "vouched"


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """What the admit script decided, with the state of each key of the reported plan."""

    replayed: bool
    outcome: Outcome
    now_ms: int
    retry_after_ms: int | None
    never_fits: bool
    reservation_id: str
    plan: int
    max_output_tokens: int | None
    keys: tuple[KeyState, ...]


@dataclass(frozen=True, slots=True)
class SettleResult:
    """The record of a settled reservation: ``status`` ok, missing or conflict."""

    status: Literal["ok", "missing", "conflict"]
    subject: Subject | None
    settled_as: str | None = None


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class BudgetStore:
    """The admission side of Redis.

    Every call fails fast with :class:`StoreUnavailable` when Redis does not answer
    (connection refused or reset, the call timing out once sent), and for ``down_s``
    afterwards does not try again, so a dead Redis costs one timeout, not one per request.
    Every call first takes a slot of ``backpressure``: waiting for a connection or for the
    event loop is answered :class:`Overloaded`, never as a Redis failure.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        refresh_s: float,
        down_s: float = 0.5,
        backpressure: Backpressure | None = None,
        staleness_ms: int = 30_000,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.refresh_s = refresh_s
        self.down_s = down_s
        self.staleness_ms = staleness_ms
        self.backpressure = backpressure or Backpressure(
            slots=32, queue=1024, wait_s=1.0, timeout_s=0.25
        )
        self._admit = client.register_script(ADMIT)
        self._settle = client.register_script(SETTLE)
        self._policies: list[Policy] | None = None
        self._version: bytes | str | None = None
        #: The partition counts the worker's marks refer to (None: not known yet).
        self.topology: Topology | None = None
        self._checked = 0.0
        self._down_until = 0.0
        self._refreshing = asyncio.Lock()

    @property
    def is_down(self) -> bool:
        """Whether the last call failed less than ``down_s`` ago."""
        return time.monotonic() < self._down_until

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        if self.is_down:
            STORE_FAILURES.labels(kind="skipped").inc()
            raise StoreUnavailable(f"Redis is unreachable ({what} skipped; retrying shortly)")
        gate = self.backpressure
        started = await gate.acquire()
        try:
            return await call()
        except _STORE_ERRORS as exc:
            reason = gate.blame(exc, started)
            if reason is not None:
                OVERLOADED.labels(reason=reason).inc()
                logger.info("Redis %s refused as overload (%s): %s", what, reason, exc)
                raise Overloaded(
                    f"this admission process is saturated ({reason}); retry shortly"
                ) from exc
            self._down_until = time.monotonic() + self.down_s
            kind = "timeout" if isinstance(exc, RedisTimeoutError | TimeoutError) else "connection"
            STORE_FAILURES.labels(kind=kind).inc()
            logger.warning("Redis %s failed: %s", what, exc)
            raise StoreUnavailable(f"Redis is unreachable: {exc}") from exc
        finally:
            gate.release()

    async def policies(self) -> list[Policy]:
        """The policies the stream processor materialized, re-read when they change.

        While Redis is down or this process is saturated the last policies read are used.

        Raises:
            StoreUnavailable: Redis is down and no policies were ever read.
            Overloaded: saturated and no policies were ever read.
        """
        if self._policies is not None and time.monotonic() - self._checked < self.refresh_s:
            return self._policies
        async with self._refreshing:
            return await self._refresh()

    async def _refresh(self) -> list[Policy]:
        # Another caller may have refreshed while this one waited for the lock.
        if self._policies is not None and time.monotonic() - self._checked < self.refresh_s:
            return self._policies
        try:
            version = await self._call(
                "policy version", lambda: self.client.get(policies_version_key(self.prefix))
            )
            # Policies seen before and now gone: Redis lost its data (flush, restart). The
            # last policies stay, so the failure modes apply: the admit script finds the
            # marks of every window gone with them and refuses to decide on them.
            lost = version is None and self._version is not None
            if not lost and (version != self._version or self._policies is None):
                raw = await self._call(
                    "policies", lambda: self.client.hgetall(policies_key(self.prefix))
                )
                self._policies = [Policy.model_validate_json(v) for v in raw.values()]
                self._version = version
                topology = await self._call(
                    "topology", lambda: self.client.get(topology_key(self.prefix))
                )
                if topology is not None:
                    self.topology = Topology.decode(topology)
        except (StoreUnavailable, Overloaded):
            if self._policies is None:
                raise
        self._checked = time.monotonic()
        return self._policies if self._policies is not None else []

    @property
    def known_policies(self) -> list[Policy] | None:
        """The policies last read, or None before the first read."""
        return self._policies

    async def admit(
        self,
        request_id: str,
        reservation_id: str,
        plans: Sequence[Plan],
        estimate_output_tokens: int,
        *,
        read_only: bool = False,
        estimate: Usage | None = None,
    ) -> AdmitResult:
        """Decide over every plan's keys and reserve on all of one plan's keys, or none.

        A reservation made keeps what its ``reserve`` event is rebuilt from and is listed
        as unpublished until the broker acks that event (``admission.sweeper``).

        Args:
            request_id: the caller's idempotency key.
            reservation_id: the id a reservation made now gets.
            plans: the request as sent, then its downgrade plans.
            estimate_output_tokens: the estimate's output tokens (what ``cap`` lowers).
            read_only: evaluate plan 0 only; reserve and store nothing.
            estimate: the estimate as sent, stored for the reserve event (default: only
                ``estimate_output_tokens``).

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated. Nothing was reserved, except when the
                script timed out after it was sent (``loop_lag``): then its reservation may
                stand, and a retry with the same request id returns it.
        """
        keys = [
            request_key(self.prefix, plans[0].subject.tenant, request_id),
            reservation_key(self.prefix, reservation_id),
            unpublished_reserves_key(self.prefix),
            marks_key(self.prefix),
        ]
        record_ttl_ms = RECORD_GRACE_MS
        args: list[int | str] = []
        marks: dict[str, int] = {}
        for plan in plans:
            args += [plan.subject.model_dump_json(exclude_defaults=True), len(plan.charges)]
            tenant_key = partition_key(plan.subject)
            for charge in plan.charges:
                policy = charge.target.policy
                keys += [
                    window_key(self.prefix, charge.target.key),
                    pending_window_key(self.prefix, charge.target.key),
                    pending_reservations_key(self.prefix, charge.target.key),
                ]
                record_ttl_ms = max(record_ttl_ms, policy.reservation_ttl_ms + RECORD_GRACE_MS)
                args += AdmitTarget(
                    limit=policy.limit,
                    window_ms=policy.window_ms,
                    bucket_ms=policy.bucket_ms,
                    boundary=policy.boundary,
                    amount=charge.amount,
                    reservation_ttl_ms=policy.reservation_ttl_ms,
                    observe=policy.mode == "observe",
                    on_exceed=_ON_EXCEED[policy.on_exceed],
                    downgrade_plan=charge.alt + 1 if charge.alt else 0,
                    cap_s=charge.cap.s,
                    cap_r=charge.cap.r,
                    cap_d=charge.cap.d,
                    deps=self._deps(marks, policy, charge.target.key, tenant_key),
                    failure=_FAILURE[policy.failure],
                ).argv()
        usage = estimate if estimate is not None else Usage(output_tokens=estimate_output_tokens)
        header = AdmitHeader(
            read_only=read_only,
            reservation_id=reservation_id,
            idempotency_ttl_ms=IDEMPOTENCY_TTL_MS,
            record_ttl_ms=record_ttl_ms,
            estimate_output_tokens=estimate_output_tokens,
            estimate_json=usage.model_dump_json(exclude_defaults=True),
            plans=len(plans),
            staleness_ms=self.staleness_ms,
            marks=tuple(marks),
        )
        args = header.argv() + args
        raw = await self._call("admit", lambda: self._admit(keys=keys, args=args))
        replayed, outcome, now_ms, retry, rid, plan, max_out, n, *rest = raw
        retry = int(retry)
        # An answer stored before the state entry existed has one entry less per key.
        per = ADMIT_REPLY_PER_TARGET if len(rest) >= int(n) * ADMIT_REPLY_PER_TARGET else 5
        states = tuple(
            KeyState(
                used=int(rest[i]),
                reserved=int(rest[i + 1]),
                own=int(rest[i + 2]),
                violated=bool(int(rest[i + 3])),
                reset_after_ms=int(rest[i + 4]),
                state=_STATES[int(rest[i + 5])] if per > 5 else "vouched",
            )
            for i in range(0, int(n) * per, per)
        )
        return AdmitResult(
            replayed=bool(int(replayed)),
            outcome=_OUTCOMES[int(outcome)],
            now_ms=int(now_ms),
            retry_after_ms=retry if retry >= 0 else None,
            never_fits=retry == -2,
            reservation_id=_text(rid),
            plan=int(plan) - 1,
            max_output_tokens=int(max_out) if int(max_out) >= 0 else None,
            keys=states,
        )

    def _deps(
        self, marks: dict[str, int], policy: Policy, key: str, tenant_key: bytes
    ) -> tuple[int, ...]:
        """The 1-based indexes into ``marks`` (grown as needed) of the marks ``key`` needs."""
        names = (
            self.topology.marks_for(policy, key, tenant_key)
            if self.topology is not None
            else (_NO_TOPOLOGY,)
        )
        return tuple(marks.setdefault(name, len(marks) + 1) for name in names)

    async def reservation_subject(self, reservation_id: str) -> Subject | None:
        """The subject an open reservation was made for, or None.

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated.
        """
        key = reservation_key(self.prefix, reservation_id)
        raw = await self._call("reservation", lambda: self.client.hget(key, "subject"))
        return None if raw is None else Subject.model_validate_json(raw)

    async def settle(self, reservation_id: str, kind: str) -> SettleResult:
        """Mark a reservation committed or released, once.

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated.
        """
        key = reservation_key(self.prefix, reservation_id)
        status, subject = await self._call("settle", lambda: self._settle(keys=[key], args=[kind]))
        text = _text(status)
        if text == "missing":
            return SettleResult("missing", None)
        parsed = Subject.model_validate_json(subject)
        if text.startswith("conflict:"):
            return SettleResult("conflict", parsed, text.removeprefix("conflict:"))
        return SettleResult("ok", parsed)

    async def ping(self) -> bool:
        """True when Redis answers."""
        return bool(await self._call("ping", self.client.ping))
