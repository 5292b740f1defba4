"""Write what admission needs into Redis: bucket amounts, absorbed reservations, policies."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from spendgate.schemas import window_codec, windows
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
from spendgate.streams.scripts import absorb, claim, heal, mark, sample
from spendgate.streams.scripts.mark import MarkReply, MarkWrite

if TYPE_CHECKING:
    from spendgate.streams.effects import KeyWrite

#: Windows rewritten per round trip by a restore.
RESTORE_KEYS_PER_TRIP = 500

#: Keys per ABSORB call: one call blocks Redis (and every admission) while it runs, so a
#: large batch is several calls in one pipeline.
ABSORB_KEYS_PER_CALL = 64


class RedisMaterializer:
    """Applies each state change to Redis in one atomic step."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        limit_of: Callable[[str], int | None] | None = None,
    ) -> None:
        """Args: limit_of: a policy id's limit in force (None: unknown policy); without
        it, windows are written without a utilization score."""
        self.client = client
        self.prefix = prefix
        self.limit_of = limit_of
        self._absorb = client.register_script(absorb.SCRIPT.source)
        self._heal = client.register_script(heal.SCRIPT.source)
        self._mark = client.register_script(mark.SCRIPT.source)
        self._claim = client.register_script(claim.SCRIPT.source)
        self._sample = client.register_script(sample.SCRIPT.source)

    async def write_batch(
        self,
        writes: Sequence[KeyWrite],
        marks: Sequence[MarkWrite] = (),
        presence: str = "",
    ) -> MarkReply | None:
        """Mirror one fold batch: every key's window and absorbed reservations in one
        pipeline of ABSORB calls (:mod:`~spendgate.streams.scripts.absorb`), each key
        atomic, never over a newer window; then, in the same round trip, the ``marks`` the
        batch advanced (MARK, :mod:`~spendgate.streams.scripts.mark`).

        Redis runs a pipeline's commands in order, so a mark is never visible before the
        windows it vouches for; an admission between them sees the old mark with newer
        windows, which is still true.

        Returns:
            What the mark script did, or None when no marks were given.
        """
        if not writes and not marks:
            return None
        async with self.client.pipeline(transaction=False) as pipe:
            for first in range(0, len(writes), ABSORB_KEYS_PER_CALL):
                parts = []
                for w in writes[first : first + ABSORB_KEYS_PER_CALL]:
                    window = w.window()
                    score = self.score(w.key, w.state, w.spec) if window is not None else None
                    parts.append(
                        self._absorb_key(w.key, window, w.spec, w.absorbed, w.version, score)
                    )
                args = absorb.AbsorbArgs(parts)
                await self._absorb(keys=args.keys(), args=args.argv(), client=pipe)
            for w in writes:
                if w.overage is not None:
                    # Read by admission for ``overage: cap_next`` policies (schemas.overage).
                    name = overage_key(self.prefix, w.key)
                    pipe.set(name, w.overage.encode(), px=w.spec.window_ms)
            if marks:
                margs = self._mark_args(marks, presence)
                await self._mark(keys=margs.keys(), args=margs.argv(), client=pipe)
            replies = await pipe.execute()
        return MarkReply.decode(replies[-1]) if marks else None

    def _absorb_key(
        self,
        key: str,
        window: bytes | None,
        spec: WindowSpec,
        reservation_ids: Iterable[str],
        version: int | None,
        score: float | None,
    ) -> absorb.AbsorbKey:
        return absorb.AbsorbKey(
            window_key=window_key(self.prefix, key),
            pending_window_key=pending_window_key(self.prefix, key),
            pending_total_key=pending_total_key(self.prefix, key),
            pending_queue_key=pending_queue_key(self.prefix, key),
            pending_reservations_key=pending_reservations_key(self.prefix, key),
            version_key=window_version_key(self.prefix, key),
            utilization_key=utilization_key(self.prefix),
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
        async with self.client.pipeline(transaction=False) as pipe:
            for i in due:
                key, state = states[i]
                spec = WindowSpec(state.window_ms, state.bucket_ms)
                args = heal.HealArgs(
                    window_key=window_key(self.prefix, key),
                    version_key=window_version_key(self.prefix, key),
                    utilization_key=utilization_key(self.prefix),
                    window=window_codec.encode(state.buckets, state.bucket_ms),
                    window_ms=state.window_ms,
                    version=state.version,
                    score=self.score(key, state, spec),
                )
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
            [self._absorb_key(key, window, spec, reservation_ids, version, score)]
        )
        reply = await self._absorb(keys=args.keys(), args=args.argv())
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
        """Replace the policies hash with ``policies``, and the topology when given."""
        pkey = policies_key(self.prefix)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(pkey)
            for policy in policies:
                pipe.hset(pkey, policy.id, policy.model_dump_json())
            if topology is not None:
                pipe.set(topology_key(self.prefix), topology.encode())
            pipe.incr(policies_version_key(self.prefix))
            await pipe.execute()

    async def write_marks(self, marks: Sequence[MarkWrite], presence: str) -> MarkReply:
        """Write applied marks, fenced (MARK, :mod:`~spendgate.streams.scripts.mark`).

        Returns:
            ``present`` False when ``presence`` (this worker's mark that Redis still holds
            what it wrote) is gone: nothing was written, the worker must claim and restore.
        """
        if not marks:
            return MarkReply(True, 0, 0)
        args = self._mark_args(marks, presence)
        return MarkReply.decode(await self._mark(keys=args.keys(), args=args.argv()))

    def _mark_args(self, marks: Sequence[MarkWrite], presence: str) -> mark.MarkArgs:
        p = self.prefix
        return mark.MarkArgs(
            marks_key=marks_key(p),
            owners_key=mark_owners_key(p),
            progress_key=mark_progress_key(p),
            positions_key=mark_positions_key(p),
            presence_key=presence,
            writes=tuple(marks),
        )

    async def claim(self, fields: Sequence[str], presence: str) -> dict[str, Claim]:
        """Claim ``fields`` for this worker (CLAIM, :mod:`~spendgate.streams.scripts.claim`):
        a fencing token each, and the mark Redis holds now; sets ``presence``."""
        if not fields:
            await self.client.set(presence, b"1")
            return {}
        p = self.prefix
        args = claim.ClaimArgs(
            owners_key=mark_owners_key(p),
            marks_key=marks_key(p),
            positions_key=mark_positions_key(p),
            presence_key=presence,
            fields=tuple(fields),
        )
        reply = claim.ClaimReply.decode(await self._claim(keys=args.keys(), args=args.argv()))
        return dict(zip(fields, reply.claims, strict=True))

    async def sample(self, usage_fields: Sequence[str]) -> tuple[int, list[int | None]]:
        """The Redis clock (ms) and the usage marks at that instant (SAMPLE,
        :mod:`~spendgate.streams.scripts.sample`)."""
        if not usage_fields:
            return await self.now_ms(), []
        args = sample.SampleArgs(marks_key(self.prefix), tuple(usage_fields))
        reply = sample.SampleReply.decode(await self._sample(keys=args.keys(), args=args.argv()))
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
        await self.client.hset(marks_key(self.prefix), mapping=marks)  # type: ignore[arg-type]
