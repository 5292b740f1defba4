"""Write what admission needs into Redis: bucket amounts, absorbed reservations, policies."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from spendgate.schemas import window_codec, windows
from spendgate.schemas.layout import Layout, shard_of
from spendgate.schemas.luascript import run_script
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import (
    mark_owners_key,
    mark_positions_key,
    mark_progress_key,
    marks_key,
    overage_key,
    pending_queue_key,
    pending_reservations_key,
    pending_total_key,
    pending_window_key,
    policies_key,
    policies_version_key,
    topology_key,
    utilization_key,
    window_key,
    window_version_key,
)
from spendgate.schemas.shards import Topology
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.ledger import KeyState
from spendgate.streams.marks import Claim
from spendgate.streams.scripts import absorb, adopt, claim, heal, mark, sample
from spendgate.streams.scripts.mark import MarkReply, MarkWrite

if TYPE_CHECKING:
    from spendgate.streams.effects import KeyWrite

#: Windows rewritten per round trip by a restore.
RESTORE_KEYS_PER_TRIP = 500

#: Keys per ABSORB call: one call blocks Redis (and every admission) while it runs, so a
#: large batch is several calls in one pipeline.
ABSORB_KEYS_PER_CALL = 64


#: Calls one materializer keeps in flight on a cluster (redis-py's cluster client refuses
#: more than its 100 connections per node).
CLUSTER_CALLS_IN_FLIGHT = 32


class RedisMaterializer:
    """Applies each state change to Redis in one atomic step.

    On a Redis Cluster (``layout.cluster``) each key's window goes to its virtual shard
    (``schemas.layout``), each shard has its own utilization index, and the marks, their
    owners and this worker's presence are kept on every shard's copy. On one Redis as on a
    cluster, a batch's windows are written first, its marks only once every window step
    succeeded.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        limit_of: Callable[[str], int | None] | None = None,
        *,
        layout: Layout | None = None,
        policy_of: Callable[[str], Policy | None] | None = None,
    ) -> None:
        """Args: limit_of: a policy id's limit in force (None: unknown policy); without
        it, windows are written without a utilization score. layout: where keys live
        (default: one Redis under ``prefix``). policy_of: a policy id's policy in force,
        which places its keys on a cluster (a key of an unknown policy: its own shard)."""
        self.client = client
        self.prefix = prefix
        self.limit_of = limit_of
        self.layout = layout or Layout(prefix)
        self.policy_of = policy_of
        self._initialized = False
        self._absorb = client.register_script(absorb.SCRIPT.source)
        self._heal = client.register_script(heal.SCRIPT.source)

    async def _concurrently(self, *calls: Awaitable[Any]) -> list[Any]:
        """Await ``calls`` (on a cluster) concurrently, at most
        :data:`CLUSTER_CALLS_IN_FLIGHT` at once; their results in order, the first failure
        raised. The cluster client learns the slots first: calls racing a client's first
        use of the cluster break its connections (redis-py)."""
        if not self._initialized:
            await self.client.initialize()
            self._initialized = True
        gate = asyncio.Semaphore(CLUSTER_CALLS_IN_FLIGHT)

        async def one(call: Awaitable[Any]) -> Any:
            async with gate:
                return await call

        return list(await asyncio.gather(*(one(c) for c in calls)))

    def shard_of(self, key: str) -> str:
        """The shard prefix budget key ``key``'s windows live under."""
        layout = self.layout
        if not layout.cluster:
            return self.prefix
        policy = self.policy_of(key.partition("|")[0]) if self.policy_of else None
        return layout.of_key(policy, key) if policy is not None else layout.shard(shard_of(key))

    def presence_on(self, shard: str, presence: str) -> str:
        """``presence`` (this worker's key under the prefix) on one shard's copy."""
        if not self.layout.cluster:
            return presence
        return shard + presence.removeprefix(self.prefix)

    async def write_batch(
        self,
        writes: Sequence[KeyWrite],
        marks: Sequence[MarkWrite] = (),
        presence: str = "",
    ) -> MarkReply | None:
        """Mirror one fold batch: every key's window and absorbed reservations in one
        pipeline of ABSORB calls (:mod:`~spendgate.streams.scripts.absorb`), each key
        atomic, never over a newer window; then, once every one of them succeeded, the
        ``marks`` the batch advanced (MARK, :mod:`~spendgate.streams.scripts.mark`).

        A mark never vouches for a write that did not happen: an ABSORB that raised (a
        script error, a refused write) raises here before any mark is sent. Neither a
        pipeline nor MULTI/EXEC would stop the mark (Redis runs every command after one
        that failed at run time), and one script for the whole batch would hold Redis (and
        every admission) for as long as it runs; so the marks take a second round trip, as
        they already do on a cluster. An admission between the two sees the old mark with
        newer windows, which is still true.

        Returns:
            What the mark script did, or None when no marks were given.

        Raises:
            RedisError: a window step failed (no mark was written) or the marks' did.
        """
        if not writes and not marks:
            return None
        calls, overages = self._window_steps(writes)
        if self.layout.cluster:
            # One slot per script call: each shard's keys apart, the calls concurrent;
            # every shard's windows before any copy of the marks.
            await self._concurrently(
                *(run_script(self.client, absorb.SCRIPT, a.keys(), a.argv()) for a in calls),
                *(self.client.set(name, value, px=px) for name, value, px in overages),
            )
        elif calls or overages:
            async with self.client.pipeline(transaction=False) as pipe:
                for args in calls:
                    await self._absorb(keys=args.keys(), args=args.argv(), client=pipe)
                for name, value, px in overages:
                    pipe.set(name, value, px=px)
                # Raises the first failed command's error once every reply is read.
                await pipe.execute()
        return await self.write_marks(marks, presence) if marks else None

    def _window_steps(
        self, writes: Sequence[KeyWrite]
    ) -> tuple[list[absorb.AbsorbArgs], list[tuple[str, str, int]]]:
        """The ABSORB calls of ``writes`` (per shard, :data:`ABSORB_KEYS_PER_CALL` keys
        each), and their overage marks as (name, value, expiry ms)."""
        calls: list[absorb.AbsorbArgs] = []
        overages: list[tuple[str, str, int]] = []
        by_shard: dict[str, list[KeyWrite]] = {}
        for w in writes:
            by_shard.setdefault(self.shard_of(w.key), []).append(w)
        for shard, group in by_shard.items():
            for first in range(0, len(group), ABSORB_KEYS_PER_CALL):
                parts = []
                for w in group[first : first + ABSORB_KEYS_PER_CALL]:
                    window = w.window()
                    score = self.score(w.key, w.state, w.spec) if window is not None else None
                    parts.append(
                        self._absorb_key(shard, w.key, window, w.spec, w.absorbed, w.version, score)
                    )
                calls.append(absorb.AbsorbArgs(parts))
            for w in group:
                if w.overage is not None:
                    # Read by admission for ``overage: cap_next`` policies (schemas.overage).
                    overages.append(
                        (overage_key(shard, w.key), w.overage.encode(), w.spec.window_ms)
                    )
        return calls, overages

    def _absorb_key(
        self,
        shard: str,
        key: str,
        window: bytes | None,
        spec: WindowSpec,
        reservation_ids: Iterable[str],
        version: int | None,
        score: float | None,
    ) -> absorb.AbsorbKey:
        return absorb.AbsorbKey(
            window_key=window_key(shard, key),
            pending_window_key=pending_window_key(shard, key),
            pending_total_key=pending_total_key(shard, key),
            pending_queue_key=pending_queue_key(shard, key),
            pending_reservations_key=pending_reservations_key(shard, key),
            version_key=window_version_key(shard, key),
            utilization_key=utilization_key(shard),
            window=window,
            window_ms=spec.window_ms,
            version=version,
            score=score,
            reservation_ids=tuple(reservation_ids),
        )

    def score(self, key: str, state: KeyState, spec: WindowSpec) -> float | None:
        """``key``'s utilization for the index: its window total at its own clock (the
        latest event time) over its policy's limit; None when either is unknown."""
        if self.limit_of is None or state.bucket_ms != spec.bucket_ms:
            return None
        # Policy ids match [a-z0-9._-]: a key's first part is its policy id, unescaped.
        limit = self.limit_of(key.partition("|")[0])
        if not limit:
            return None
        return windows.total(spec, state.buckets, state.high_ms) / limit

    async def heal(self, key: str, state: KeyState) -> bool:
        """Rewrite ``key``'s window from ``state`` if Redis differs and holds nothing newer.

        Returns:
            Whether the window was rewritten (drift found and healed).
        """
        return (await self.heal_many([(key, state)]))[0]

    async def heal_many(self, states: Sequence[tuple[str, KeyState]]) -> list[bool]:
        """:meth:`heal` for each ``(key, state)``, in one pipeline; whether each was healed."""
        healed = [False] * len(states)
        due = [i for i, (_, state) in enumerate(states) if state.bucket_ms and state.window_ms]
        if not due:
            return healed
        calls = []
        for i in due:
            key, state = states[i]
            spec = WindowSpec(state.window_ms, state.bucket_ms)
            shard = self.shard_of(key)
            calls.append(
                heal.HealArgs(
                    window_key=window_key(shard, key),
                    version_key=window_version_key(shard, key),
                    utilization_key=utilization_key(shard),
                    window=window_codec.encode(state.buckets, state.bucket_ms),
                    window_ms=state.window_ms,
                    version=state.version,
                    score=self.score(key, state, spec),
                )
            )
        if self.layout.cluster:
            replies = await self._concurrently(
                *(run_script(self.client, heal.SCRIPT, a.keys(), a.argv()) for a in calls)
            )
        else:
            async with self.client.pipeline(transaction=False) as pipe:
                for args in calls:
                    await self._heal(keys=args.keys(), args=args.argv(), client=pipe)
                replies = await pipe.execute()
        for i, reply in zip(due, replies, strict=True):
            healed[i] = heal.HealReply.decode(reply).rewritten
        return healed

    async def absorb(
        self,
        key: str,
        window: bytes | None,
        spec: WindowSpec,
        reservation_ids: Iterable[str],
        version: int | None = None,
        score: float | None = None,
    ) -> int:
        """Write ``key``'s window and take reservations out of its pending window, atomically.

        Args:
            key: the budget key.
            window: the encoded window to store, or None to leave it as it is.
            spec: the policy's window (the stored value's expiry).
            reservation_ids: reservations whose reserve the window now accounts for (or
                never will: late or already settled); their pending amounts leave.
            version: the window's version, written beside it; the window is written
                only if Redis holds no newer one (None: no version, no compare).
            score: the window's utilization for the index, set with the window (None:
                the index is left as it is).

        Returns:
            The pending amount moved out.
        """
        args = absorb.AbsorbArgs(
            [
                self._absorb_key(
                    self.shard_of(key), key, window, spec, reservation_ids, version, score
                )
            ]
        )
        reply = await run_script(self.client, absorb.SCRIPT, args.keys(), args.argv())
        return absorb.AbsorbReply.decode(reply).moved

    async def restore(
        self, states: Iterable[tuple[str, KeyState]], trip_timeout_s: float | None = None
    ) -> int:
        """Rewrite windows from their table states (after Redis lost its data, or when a
        partition moved here), :data:`RESTORE_KEYS_PER_TRIP` per round trip.

        A compare-and-set like :meth:`heal`: records applied while the restore runs write
        newer versions, which the restore never overwrites with its older snapshot.

        Returns:
            How many windows were restored.
        """
        n = 0
        chunk: list[tuple[str, KeyState]] = []
        for item in states:
            chunk.append(item)
            if len(chunk) >= RESTORE_KEYS_PER_TRIP:
                await asyncio.wait_for(self.heal_many(chunk), trip_timeout_s)
                n, chunk = n + len(chunk), []
        if chunk:
            await asyncio.wait_for(self.heal_many(chunk), trip_timeout_s)
            n += len(chunk)
        return n

    async def write_policies(
        self, policies: Iterable[Policy], topology: Topology | None = None
    ) -> None:
        """Replace the policies hash with ``policies``, and the topology when given (one
        transaction, on the layout's control shard)."""
        control = self.layout.control
        pkey = policies_key(control)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(pkey)
            for policy in policies:
                pipe.hset(pkey, policy.id, policy.model_dump_json())
            if topology is not None:
                pipe.set(topology_key(control), topology.encode())
            pipe.incr(policies_version_key(control))
            await pipe.execute()

    async def write_marks(self, marks: Sequence[MarkWrite], presence: str) -> MarkReply:
        """Write applied marks, fenced (MARK, :mod:`~spendgate.streams.scripts.mark`).

        Returns:
            ``present`` False when ``presence`` (this worker's mark that Redis still holds
            what it wrote) is gone: nothing was written, the worker must claim and restore.
        """
        if not marks:
            return MarkReply(True, 0, 0)
        # Every copy: present only if every shard still has this worker's presence; a
        # field counts as written once any copy took it, as fenced once any copy refused.
        calls = [
            self._mark_args(shard, marks, self.presence_on(shard, presence))
            for shard in self.layout.shards()
        ]
        replies = [
            MarkReply.decode(r)
            for r in await self._concurrently(
                *(run_script(self.client, mark.SCRIPT, a.keys(), a.argv()) for a in calls)
            )
        ]
        if len(replies) == 1:
            return replies[0]
        return MarkReply(
            all(r.present for r in replies),
            max(r.written for r in replies),
            max(r.fenced for r in replies),
        )

    def _mark_args(self, shard: str, marks: Sequence[MarkWrite], presence: str) -> mark.MarkArgs:
        return mark.MarkArgs(
            marks_key=marks_key(shard),
            owners_key=mark_owners_key(shard),
            progress_key=mark_progress_key(shard),
            positions_key=mark_positions_key(shard),
            presence_key=presence,
            writes=tuple(marks),
        )

    async def claim(
        self, fields: Sequence[str], presence: str, generation: int | None = None
    ) -> dict[str, Claim]:
        """Claim ``fields`` for this worker (CLAIM, :mod:`~spendgate.streams.scripts.claim`):
        a fencing token each, ordered by the group ``generation`` first (None: unknown),
        and the mark Redis holds now; sets ``presence``."""
        shards = self.layout.shards()
        if not fields:
            for shard in shards:
                await self.client.set(self.presence_on(shard, presence), b"1")
            return {}
        first = shards[0]
        args = claim.ClaimArgs(
            owners_key=mark_owners_key(first),
            marks_key=marks_key(first),
            positions_key=mark_positions_key(first),
            presence_key=self.presence_on(first, presence),
            fields=tuple(fields),
            generation=generation or 0,
        )
        raw = await run_script(self.client, claim.SCRIPT, args.keys(), args.argv())
        claims = dict(zip(fields, claim.ClaimReply.decode(raw).claims, strict=True))
        if len(shards) > 1:
            # The other copies fence the last owner from now on too (ADOPT).
            tokens = {f: c.token for f, c in claims.items()}
            adopts = [
                adopt.AdoptArgs(mark_owners_key(s), self.presence_on(s, presence), tokens)
                for s in shards[1:]
            ]
            await self._concurrently(
                *(run_script(self.client, adopt.SCRIPT, a.keys(), a.argv()) for a in adopts)
            )
        return claims

    async def sample(self, usage_fields: Sequence[str]) -> tuple[int, list[int | None]]:
        """The Redis clock (ms) and the usage marks at that instant (SAMPLE,
        :mod:`~spendgate.streams.scripts.sample`)."""
        if not usage_fields:
            return await self.now_ms(), []
        # On a cluster, the first shard's copy: every copy is written with the same marks.
        args = sample.SampleArgs(marks_key(self.layout.shards()[0]), tuple(usage_fields))
        raw = await run_script(self.client, sample.SCRIPT, args.keys(), args.argv())
        reply = sample.SampleReply.decode(raw)
        return reply.now_ms, list(reply.marks)

    async def now_ms(self) -> int:
        """The Redis clock in ms."""
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def stand_in(self, policies: Iterable[Policy], topology: Topology, until_ms: int) -> None:
        """Play a worker caught up on every partition until ``until_ms``: write the policies
        and every applied mark. Only for setups with no worker (admission tests and
        benchmarks that write windows straight into Redis)."""
        await self.write_policies(policies, topology)
        marks = dict.fromkeys(topology.all_marks(), until_ms)
        for shard in self.layout.shards():
            await self.client.hset(marks_key(shard), mapping=marks)  # type: ignore[arg-type]
