"""Redis access for admission: the policies in force and the atomic admit/settle scripts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ClusterDownError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from spendgate.admission import resp
from spendgate.admission.backpressure import Backpressure
from spendgate.admission.decide import (
    AdmitResult,
    CapTerms,
    Charge,
    KeyState,
    Plan,
    PolicyTerms,
)
from spendgate.admission.exceptions import Overloaded, StoreUnavailable
from spendgate.admission.metrics import OVERLOADED, STORE_FAILURES
from spendgate.admission.pieces import admit_across, extend_across
from spendgate.admission.replicated import run_replicated
from spendgate.admission.reserves import IDEMPOTENCY_TTL_MS, RECORD_GRACE_MS
from spendgate.admission.scripts import admit as admit_script
from spendgate.admission.scripts import extend as extend_script
from spendgate.admission.scripts import settle as settle_script
from spendgate.admission.scripts.admit import AdmitCall, AdmitHeader, encode_deps
from spendgate.admission.scripts.codes import FAILURE_MODES
from spendgate.admission.scripts.extend import ExtendArgs, ExtendResult, ExtendTarget
from spendgate.admission.scripts.settle import SettleArgs, SettleResult
from spendgate.schemas import window_codec
from spendgate.schemas.backoff import connection_lost
from spendgate.schemas.events import Subject, Usage, partition_key
from spendgate.schemas.layout import Layout
from spendgate.schemas.luascript import LuaScript, run_script
from spendgate.schemas.overage import OverageMark
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import (
    burst_key,
    extend_key,
    held_keys,
    marks_key,
    overage_key,
    pending_total_key,
    pending_window_key,
    policies_key,
    policies_version_key,
    request_key,
    reservation_key,
    topology_key,
    unpublished_reserves_key,
    window_key,
)
from spendgate.schemas.redis_values import SUBJECT_FIELD, Settled
from spendgate.schemas.shards import Topology, partition_for, usage_mark

__all__ = [
    "AdmitResult",
    "BudgetStore",
    "CapTerms",
    "Charge",
    "ExtendResult",
    "KeyState",
    "Plan",
    "SettleResult",
]

logger = logging.getLogger(__name__)


#: A mark field no worker writes: without a topology every window counts as missing.
_NO_TOPOLOGY = "topology-unknown"
#: A cluster answering CLUSTERDOWN, TRYAGAIN or with no master for a slot (a failover in
#: progress) is unreachable for that call too.
_STORE_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
)
#: Mark dependencies remembered per budget key (cleared when full or the topology changes).
_DEPS_MEMORY = 100_000
T = TypeVar("T")


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
        layout: Layout | None = None,
        piece_grace_ms: int = 30_000,
        wait_replicas: int = 0,
        wait_ms: int = 100,
    ) -> None:
        self.client = client
        self.prefix = prefix
        #: Where each key lives: one Redis, or a cluster's virtual shards.
        self.layout = layout or Layout(prefix)
        #: A piece of a request spanning shards unsealed this long is swept (released).
        self.piece_grace_ms = piece_grace_ms
        #: On a cluster: replicas that must hold a step's holds before it is answered
        #: (``admission.replicated``; 0: answered once the master has them).
        self.wait_replicas = wait_replicas if self.layout.cluster else 0
        self.wait_ms = wait_ms
        self.refresh_s = refresh_s
        self.down_s = down_s
        self.staleness_ms = staleness_ms
        self.backpressure = backpressure or Backpressure(
            slots=32, queue=1024, wait_s=1.0, timeout_s=0.25
        )
        self._admit_sha = admit_script.SCRIPT.sha
        self._settle = client.register_script(settle_script.SCRIPT.source)
        self._extend = client.register_script(extend_script.SCRIPT.source)
        self._policies: list[Policy] | None = None
        self._version: bytes | str | None = None
        #: The partition counts the worker's marks refer to (None: not known yet).
        self.topology: Topology | None = None
        #: Mark names per tenant (tenant-scoped keys) and per budget key (the others).
        self._tenant_marks: dict[str, tuple[str, ...]] = {}
        self._key_marks: dict[str, tuple[str, ...]] = {}
        self._marks_of: Topology | None = None
        #: The virtual shard of each budget key seen (on a cluster).
        self._shards: dict[str, int] = {}
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
            try:
                return await call()
            except (AttributeError, TypeError, RuntimeError) as exc:
                if not connection_lost(exc):
                    raise
                raise RedisConnectionError(f"connection lost mid-call ({exc!r})") from exc
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
                "policy version", lambda: self.client.get(policies_version_key(self.layout.control))
            )
            # Policies seen before and now gone: Redis lost its data (flush, restart). The
            # last policies stay, so the failure modes apply: the admit script finds the
            # marks of every window gone with them and refuses to decide on them.
            lost = version is None and self._version is not None
            if not lost and (version != self._version or self._policies is None):
                raw = await self._call(
                    "policies", lambda: self.client.hgetall(policies_key(self.layout.control))
                )
                self._policies = [Policy.model_validate_json(v) for v in raw.values()]
                self._version = version
                # A policy edit can move a key to another shard (an exact tenant match).
                self._shards.clear()
                topology = await self._call(
                    "topology", lambda: self.client.get(topology_key(self.layout.control))
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
        as unpublished until the broker acks that event (``admission.sweeper``). On a
        cluster a request whose keys all live on its home shard is this one script call
        there; one whose keys span shards is admitted piece by piece
        (``admission.pieces``).

        Args:
            request_id: the caller's idempotency key.
            reservation_id: the unique part of the id a reservation made now gets (on a
                cluster the id also names the home shard: :meth:`new_reservation_id`).
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
        usage = estimate if estimate is not None else Usage(output_tokens=estimate_output_tokens)
        prefix = self.prefix
        layout = self.layout
        if layout.cluster:
            home = layout.home_shard(plans[0].subject.tenant)
            reservation_id = layout.reservation_id(home, reservation_id)
            if any(self.shard_of(c) != home for plan in plans for c in plan.charges):
                return await admit_across(
                    self, request_id, reservation_id, plans, usage, read_only=read_only
                )
            prefix = layout.shard(home)
        call = AdmitCall(
            request_key(prefix, plans[0].subject.tenant, request_id),
            reservation_key(prefix, reservation_id),
            unpublished_reserves_key(prefix),
            marks_key(prefix),
        )
        record_ttl_ms, marks = self.add_plans(call, prefix, plans)
        header = AdmitHeader(
            read_only=read_only,
            reservation_id=reservation_id,
            idempotency_ttl_ms=IDEMPOTENCY_TTL_MS,
            record_ttl_ms=record_ttl_ms,
            estimate_output_tokens=estimate_output_tokens,
            estimate_json=usage.model_dump_json(exclude_defaults=True),
            plans=len(plans),
            staleness_ms=self.staleness_ms,
            marks=marks,
        )
        keys, args = call.finish(header)
        raw = await self._call("admit", lambda: self.run_admit(keys, args))
        return AdmitResult.decode(raw)

    def new_reservation_id(self, tenant: str | None, unique: str) -> str:
        """The id of a reservation made for ``tenant`` (on a cluster it names the
        tenant's home shard, so commit, release and extend find its record)."""
        layout = self.layout
        return layout.reservation_id(layout.home_shard(tenant), unique)

    def shard_of(self, charge: Charge) -> int:
        """The virtual shard of a charge's budget key (``schemas.layout``), remembered."""
        key = charge.target.key
        found = self._shards.get(key)
        if found is None:
            if len(self._shards) >= _DEPS_MEMORY:
                self._shards.clear()
            found = self._shards[key] = self.layout.key_shard(charge.target.policy, key)
        return found

    async def run_admit(self, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        """One ADMIT call (no backpressure of its own: callers wrap it in ``_call``)."""
        if self.layout.cluster:
            return await self._routed(admit_script.SCRIPT, keys, args, durable=True)
        source = admit_script.SCRIPT.source
        return await resp.evalsha(self.client, self._admit_sha, source, keys, args)

    async def run(
        self,
        what: str,
        script: LuaScript,
        keys: Sequence[str],
        args: Sequence[bytes | str | int],
        *,
        durable: bool = False,
    ) -> Any:
        """One call of ``script``, routed by its keys on a cluster, with backpressure;
        ``durable``: answered only once ``wait_replicas`` replicas hold its writes."""
        return await self._call(what, lambda: self._routed(script, keys, args, durable=durable))

    async def _routed(
        self,
        script: LuaScript,
        keys: Sequence[str],
        args: Sequence[bytes | str | int],
        *,
        durable: bool,
    ) -> Any:
        if durable and self.wait_replicas > 0:
            cluster: Any = self.client
            return await run_replicated(
                cluster, script, keys, args, replicas=self.wait_replicas, timeout_ms=self.wait_ms
            )
        return await run_script(self.client, script, keys, args)

    def add_plans(
        self, call: AdmitCall, prefix: str, plans: Sequence[Plan], *, alternatives: bool = True
    ) -> tuple[int, tuple[str, ...]]:
        """Add every plan's targets to ``call``, their keys under ``prefix``.

        Args:
            alternatives: False: a key of a downgrade or route policy refuses as a
                ``reject`` key does (a piece never tries another plan itself).

        Returns:
            The record's TTL (ms) and the mark fields the targets depend on.
        """
        record_ttl_ms = RECORD_GRACE_MS
        marks: dict[str, int] = {}
        for plan in plans:
            subject = plan.subject
            call.plan(subject.model_dump_json(exclude_defaults=True), len(plan.charges))
            for charge in plan.charges:
                key = charge.target.key
                terms = charge.terms or PolicyTerms.of(charge.target.policy)
                ttl_ms = terms.reservation_ttl_ms + RECORD_GRACE_MS
                if ttl_ms > record_ttl_ms:
                    record_ttl_ms = ttl_ms
                cap = charge.cap
                call.target(
                    held_keys(prefix, key),
                    burst_key(prefix, key) if terms.burst is not None else None,
                    terms.template.argv(
                        charge.amount,
                        charge.alt + 1 if charge.alt and alternatives else 0,
                        cap.s,
                        cap.r,
                        cap.d,
                        self._deps(marks, terms, key, subject),
                    ),
                )
        return record_ttl_ms, tuple(marks)

    def _deps(self, marks: dict[str, int], terms: PolicyTerms, key: str, subject: Subject) -> str:
        """The ``deps`` entry of ``key``: the 1-based indexes into ``marks`` (grown as
        needed) of the marks its window depends on."""
        topology = self.topology
        if topology is not self._marks_of:
            self._tenant_marks.clear()
            self._key_marks.clear()
            self._marks_of = topology
        if topology is None:
            names: tuple[str, ...] = (_NO_TOPOLOGY,)
        elif terms.tenant_scoped:
            # One usage partition, found by the tenant (Kafka's murmur2 of the record key).
            tenant = subject.tenant or "_"
            names = self._tenant_marks.get(tenant) or self._remember(
                self._tenant_marks,
                tenant,
                (usage_mark(partition_for(partition_key(subject), topology.usage)),),
            )
        else:
            found = self._key_marks.get(key)
            names = found or self._remember(
                self._key_marks, key, topology.marks_for(terms.policy, key, b"")
            )
        return encode_deps(tuple(marks.setdefault(name, len(marks) + 1) for name in names))

    @staticmethod
    def _remember(
        memory: dict[str, tuple[str, ...]], key: str, names: tuple[str, ...]
    ) -> tuple[str, ...]:
        if len(memory) >= _DEPS_MEMORY:
            memory.clear()
        memory[key] = names
        return names

    async def reservation_subject(self, reservation_id: str) -> Subject | None:
        """The subject an open reservation was made for, or None.

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated.
        """
        home = self._home_of(reservation_id)
        if home is None:
            return None
        key = reservation_key(home, reservation_id)
        raw = await self._call("reservation", lambda: self.client.hget(key, SUBJECT_FIELD))
        return None if raw is None else Subject.model_validate_json(raw)

    def _home_of(self, reservation_id: str) -> str | None:
        """The shard prefix of a reservation's record; None for an id that names no shard
        of this cluster (never made here: no such reservation)."""
        try:
            return self.layout.of_reservation(reservation_id)
        except ValueError:
            return None

    async def settle(self, reservation_id: str, kind: Settled) -> SettleResult:
        """Mark a reservation committed or released, once.

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated.
        """
        home = self._home_of(reservation_id)
        if home is None:
            return SettleResult("missing", None)
        call = SettleArgs(reservation_key(home, reservation_id), kind)
        if self.layout.cluster:
            raw = await self.run("settle", settle_script.SCRIPT, call.keys(), call.argv())
        else:
            raw = await self._call(
                "settle", lambda: self._settle(keys=call.keys(), args=call.argv())
            )
        return SettleResult.decode(raw)

    async def extend(
        self, entry: str, reservation_id: str, seq: int, subject: Subject, charges: Sequence[Charge]
    ) -> ExtendResult:
        """Grow an open reservation by each charge's amount on every key, or on none.

        Args:
            entry: the extend's event id, the name of its pending entry.
            reservation_id: the reservation to grow.
            seq: the extend's sequence number (a repeat returns the first answer).
            subject: the reservation's subject (finds the keys' marks).
            charges: every budget key the reservation's subject matches, with the amount.

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated.
        On a cluster, a reservation whose keys span shards grows piece by piece
        (``admission.pieces.extend_across``).
        """
        prefix = self._home_of(reservation_id)
        if prefix is None:
            return ExtendResult(False, "missing", 0, ())
        if self.layout.cluster and any(self._prefix_of(c) != prefix for c in charges):
            return await extend_across(self, entry, reservation_id, seq, subject, charges)
        call = self.extend_args(prefix, entry, reservation_id, seq, subject, charges)
        if self.layout.cluster:
            raw = await self.run(
                "extend", extend_script.SCRIPT, call.keys(), call.argv(), durable=True
            )
        else:
            raw = await self._call(
                "extend", lambda: self._extend(keys=call.keys(), args=call.argv())
            )
        return ExtendResult.decode(raw)

    def extend_args(
        self,
        prefix: str,
        entry: str,
        reservation_id: str,
        seq: int,
        subject: Subject,
        charges: Sequence[Charge],
        mode: str = "",
    ) -> ExtendArgs:
        """One EXTEND call on shard ``prefix`` over ``charges`` (``mode``: see
        ``ExtendArgs``)."""
        marks: dict[str, int] = {}
        targets = []
        for charge in charges:
            key = charge.target.key
            policy = charge.target.policy
            terms = charge.terms or PolicyTerms.of(policy)
            targets.append(
                ExtendTarget(
                    held_keys=held_keys(prefix, key),
                    limit=policy.limit,
                    window_ms=terms.window_ms,
                    bucket_ms=policy.bucket_ms,
                    boundary=policy.boundary,
                    amount=charge.amount,
                    observe=policy.mode == "observe",
                    failure=FAILURE_MODES[policy.failure],
                    deps=self._deps(marks, terms, key, subject),
                    reservation_ttl_ms=policy.reservation_ttl_ms,
                )
            )
        return ExtendArgs(
            answer_key=extend_key(prefix, reservation_id, seq),
            record_key=reservation_key(prefix, reservation_id),
            marks_key=marks_key(prefix),
            entry=entry,
            answer_ttl_ms=IDEMPOTENCY_TTL_MS,
            staleness_ms=self.staleness_ms,
            marks=tuple(marks),
            targets=tuple(targets),
            mode=mode,
        )

    def _prefix_of(self, charge: Charge) -> str:
        """The shard prefix of a charge's budget key (the prefix without a cluster)."""
        return self.layout.shard(self.shard_of(charge)) if self.layout.cluster else self.prefix

    async def buckets(self, charges: Sequence[Charge]) -> list[dict[int, int]]:
        """Each charge's budget key: its absorbed window plus its pending reservations,
        bucket by bucket (what the admit script counts), in one pipeline.

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated.
        """

        async def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for charge in charges:
                key, prefix = charge.target.key, self._prefix_of(charge)
                pipe.get(window_key(prefix, key))
                pipe.hgetall(pending_window_key(prefix, key))
                pipe.hgetall(pending_total_key(prefix, key))
            return list(await pipe.execute())

        raw = await self._call("windows", read)
        return [
            window_codec.read_held(
                raw[3 * i], c.target.policy.bucket_ms, raw[3 * i + 1], raw[3 * i + 2]
            )
            for i, c in enumerate(charges)
        ]

    async def overage_marks(self, charges: Sequence[Charge]) -> list[OverageMark | None]:
        """The last overage of each charge's budget key (``schemas.overage``), None where
        none.

        Raises:
            StoreUnavailable: Redis did not answer.
            Overloaded: this process is saturated.
        """
        names = [overage_key(self._prefix_of(c), c.target.key) for c in charges]
        if self.layout.cluster:
            cluster: Any = self.client
            raw = await self._call("overage", lambda: cluster.mget_nonatomic(names))
        else:
            raw = await self._call("overage", lambda: self.client.mget(names))
        return [OverageMark.decode(v) for v in raw]

    async def ping(self) -> bool:
        """True when Redis answers."""
        return bool(await self._call("ping", self.client.ping))
