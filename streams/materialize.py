"""Write what admission needs into Redis: bucket amounts, absorbed reservations, policies."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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
    pending_reservations_key,
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

if TYPE_CHECKING:
    from spendgate.streams.fold import KeyWrite

# Write windows and move the reservations they now hold out of their pending windows; each
# key in one atomic step: at no instant does a reservation count twice or not at all.
#
# Each window is a compare-and-set on its version: a worker that lost the key's partition
# in a rebalance (its last batch still in flight, or itself dropped from the group while
# folding) must not overwrite what the partition's new owner wrote since. A version is the
# key's applied records by position (KeyState.version), so the newer write has the higher
# one; an equal version holds the same records.
#
# A window written also sets its score in the utilization index (the dashboard's top-N):
# one ZADD per key, under the same compare-and-set, so a stale writer moves neither.
#
# Per key, 5 KEYS and 5 + n ARGV:
# KEYS  the window (string, schemas.window_codec layout); the pending window (hash: a
#       bucket's last ms -> amount pending there); the pending reservations (hash:
#       reservation id -> "field:amount"); the window's version; the utilization index
#       (sorted set: window key -> total / limit, schemas.redis_keys.utilization_key)
# ARGV  the window's new value, or "" to leave it as it is; its PX (ms); its version, or ""
#       for none (no compare); its utilization score, or "" for none; n; then n
#       reservation ids whose reserve the window now holds (or never will: a late or
#       settled reserve)
# Returns the pending amount moved out.
# A reservation with no record was never pending here, or its record went with its
# bucket's age; either way nothing of it counts in the pending window any more. Absorbing
# is idempotent, so a stale writer's ids are absorbed too (the newer window holds them).
ABSORB = r"""
local moved = 0
local a = 1
for k = 1, #KEYS, 5 do
  local window, px, version, score = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local n = tonumber(ARGV[a + 4])
  local newer = false
  if version ~= '' then
    local have = tonumber(redis.call('GET', KEYS[k + 3]) or '-1')
    newer = have > tonumber(version)
    if not newer then redis.call('SET', KEYS[k + 3], version, 'PX', px) end
  end
  if window ~= '' and not newer then
    redis.call('SET', KEYS[k], window, 'PX', px)
    if score ~= '' then redis.call('ZADD', KEYS[k + 4], score, KEYS[k]) end
  end
  for i = a + 5, a + 4 + n do
    local record = redis.call('HGET', KEYS[k + 2], ARGV[i])
    if record then
      redis.call('HDEL', KEYS[k + 2], ARGV[i])
      local field, amount = string.match(record, '^(%d+):(%d+)$')
      amount = tonumber(amount)
      local held = tonumber(redis.call('HGET', KEYS[k + 1], field) or '0')
      if held > amount then
        redis.call('HINCRBY', KEYS[k + 1], field, string.format('%d', -amount))
      else
        -- Pruned (its bucket left the window) or exactly this amount: nothing stays.
        redis.call('HDEL', KEYS[k + 1], field)
      end
      moved = moved + math.min(held, amount)
    end
  end
  a = a + 5 + n
end
return moved
"""

#: Windows rewritten per round trip by a restore.
RESTORE_KEYS_PER_TRIP = 500

#: Keys per ABSORB call: one call blocks Redis (and every admission) while it runs, so a
#: large batch is several calls in one pipeline.
ABSORB_KEYS_PER_CALL = 64

# Heal one window that differs from the worker's table, unless a newer one was written.
#
# KEYS[1] the window               KEYS[2] the window's version
# KEYS[3] the utilization index (see ABSORB)
# ARGV[1] the window as the table holds it   ARGV[2] PX (ms)   ARGV[3] its version
# ARGV[4] its utilization score, or "" for none (set with the window it belongs to)
# Returns 1 when the window was rewritten, 0 when it matched or Redis holds a newer one.
# A matching window whose version is behind is not drift: records that move the version
# without changing the window (a commit of exactly its reservation, a duplicate) are not
# written to Redis, so only the version is brought forward.
HEAL = r"""
local have = tonumber(redis.call('GET', KEYS[2]) or '-1')
if have > tonumber(ARGV[3]) then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if have < tonumber(ARGV[3]) then redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2]) end
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[3], ARGV[4], KEYS[1]) end
return 1
"""


# Claim partitions for this worker (on every assignment, and after a loss of Redis data).
#
# KEYS[1] the marks' owners (hash: mark field -> fencing token)
# KEYS[2] the marks (hash: mark field -> watermark ms)
# KEYS[3] the marks' positions (hash: mark field -> next offset to apply, see MARK)
# KEYS[4] this worker's presence mark (set here; gone later: Redis lost its data)
# ARGV    the mark fields claimed
# Returns, per field, its new token (greater than every earlier owner's), the mark Redis
# holds and the position written with it ("" when missing): the new owner never claims
# below the mark, and need not apply again what the last owner applied.
CLAIM = r"""
redis.call('SET', KEYS[4], '1')
local out = {}
for i = 1, #ARGV do
  out[#out + 1] = redis.call('HINCRBY', KEYS[1], ARGV[i], 1)
  out[#out + 1] = redis.call('HGET', KEYS[2], ARGV[i]) or ''
  out[#out + 1] = redis.call('HGET', KEYS[3], ARGV[i]) or ''
end
return out
"""

# The Redis clock and the usage marks at one instant (streams.marks: upstream samples).
#
# KEYS[1] the marks     ARGV the usage mark fields
# Returns {now ms, then one mark per field ("" when missing)}.
SAMPLE = r"""
local t = redis.call('TIME')
local out = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
local marks = redis.call('HMGET', KEYS[1], unpack(ARGV))
for i = 1, #ARGV do out[i + 1] = marks[i] or '' end
return out
"""

# Write applied marks, fenced, unless Redis lost its data since this worker claimed them.
#
# KEYS[1] the marks (hash: mark field -> watermark ms)
# KEYS[2] the marks' owners (hash: mark field -> fencing token, see CLAIM)
# KEYS[3] the marks' progress (hash: mark field -> "<records behind>:<Redis ms>")
# KEYS[4] the marks' positions (hash: mark field -> next offset to apply: every record of
#         the partition before it is applied in Redis; only ever raised)
# KEYS[5] this worker's presence mark (gone: Redis lost its data; restore, claim again)
# ARGV    quintuples: mark field, token, watermark ms ("" to leave it), records behind
#         ("" for unknown), position ("" for unknown)
# Returns {1 or 0 (presence gone: nothing written), marks written, writes fenced}. A write
# is fenced when its token is below the owner's in Redis; a watermark not above the one
# held under the same token is left as it is.
MARK = r"""
if redis.call('EXISTS', KEYS[5]) == 0 then return {0, 0, 0} end
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local written, fenced = 0, 0
for i = 1, #ARGV, 5 do
  local field, token, w, behind = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local position = ARGV[i + 4]
  local owner = tonumber(redis.call('HGET', KEYS[2], field) or '-1')
  if token < owner then
    fenced = fenced + 1
  else
    if w ~= '' then
      local have = tonumber(redis.call('HGET', KEYS[1], field) or '-1')
      if token > owner or tonumber(w) > have then
        redis.call('HSET', KEYS[1], field, w)
        redis.call('HSET', KEYS[2], field, token)
        written = written + 1
      end
    end
    if behind ~= '' then redis.call('HSET', KEYS[3], field, behind .. ':' .. now) end
    if position ~= '' then
      local was = tonumber(redis.call('HGET', KEYS[4], field) or '-1')
      if tonumber(position) > was then redis.call('HSET', KEYS[4], field, position) end
    end
  end
end
return {1, written, fenced}
"""


@dataclass(frozen=True, slots=True)
class MarkWrite:
    """One mark for :data:`MARK`: its owner's token, the watermark (None: leave it), and
    the records its owner is behind (None: unknown)."""

    field: str
    token: int
    watermark_ms: int | None
    behind: int | None = None
    #: The next offset to apply (every record before it is applied in Redis).
    position: int | None = None


@dataclass(frozen=True, slots=True)
class MarkReply:
    """What :data:`MARK` did: whether Redis still held this worker's presence mark, how
    many marks it wrote, and how many writes it refused (a newer owner holds them)."""

    present: bool
    written: int
    fenced: int


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
        self._absorb = client.register_script(ABSORB)
        self._heal = client.register_script(HEAL)
        self._mark = client.register_script(MARK)
        self._claim = client.register_script(CLAIM)
        self._sample = client.register_script(SAMPLE)

    async def write_batch(
        self,
        writes: Sequence[KeyWrite],
        marks: Sequence[MarkWrite] = (),
        presence: str = "",
    ) -> MarkReply | None:
        """Mirror one fold batch: every key's window and absorbed reservations in one
        pipeline of :data:`ABSORB` calls, each key atomic, never over a newer window; then,
        in the same round trip, the ``marks`` the batch advanced (:data:`MARK`).

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
                keys: list[str] = []
                args: list[bytes | str | int] = []
                for w in writes[first : first + ABSORB_KEYS_PER_CALL]:
                    keys += self._absorb_keys(w.key)
                    window = w.window()
                    score = self.score(w.key, w.state, w.spec) if window is not None else None
                    args += _absorb_args(window, w.spec, w.version, list(w.absorbed), score)
                await self._absorb(keys=keys, args=args, client=pipe)
            for w in writes:
                if w.overage is not None:
                    # Read by admission for ``overage: cap_next`` policies (schemas.overage).
                    name = overage_key(self.prefix, w.key)
                    pipe.set(name, w.overage.encode(), px=w.spec.window_ms)
            if marks:
                await self._mark(
                    keys=self._mark_keys(presence), args=_mark_args(marks), client=pipe
                )
            replies = await pipe.execute()
        return _mark_reply(replies[-1]) if marks else None

    def _absorb_keys(self, key: str) -> list[str]:
        return [
            window_key(self.prefix, key),
            pending_window_key(self.prefix, key),
            pending_reservations_key(self.prefix, key),
            window_version_key(self.prefix, key),
            utilization_key(self.prefix),
        ]

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
                keys = [
                    window_key(self.prefix, key),
                    window_version_key(self.prefix, key),
                    utilization_key(self.prefix),
                ]
                value = window_codec.encode(state.buckets, state.bucket_ms)
                spec = WindowSpec(state.window_ms, state.bucket_ms)
                args: list[bytes | int | str] = [
                    value,
                    2 * state.window_ms,
                    state.version,
                    _score_arg(self.score(key, state, spec)),
                ]
                await self._heal(keys=keys, args=args, client=pipe)
            replies = await pipe.execute()
        for i, reply in zip(due, replies, strict=True):
            healed[i] = bool(reply)
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
        args = _absorb_args(window, spec, version, list(reservation_ids), score)
        return int(await self._absorb(keys=self._absorb_keys(key), args=args))

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
        """Write applied marks, fenced (:data:`MARK`).

        Returns:
            ``present`` False when ``presence`` (this worker's mark that Redis still holds
            what it wrote) is gone: nothing was written, the worker must claim and restore.
        """
        if not marks:
            return MarkReply(True, 0, 0)
        reply = await self._mark(keys=self._mark_keys(presence), args=_mark_args(marks))
        return _mark_reply(reply)

    def _mark_keys(self, presence: str) -> list[str]:
        p = self.prefix
        return [
            marks_key(p),
            mark_owners_key(p),
            mark_progress_key(p),
            mark_positions_key(p),
            presence,
        ]

    async def claim(self, fields: Sequence[str], presence: str) -> dict[str, Claim]:
        """Claim ``fields`` for this worker (:data:`CLAIM`): a fencing token each, and the
        mark Redis holds now; sets ``presence``."""
        p = self.prefix
        keys = [mark_owners_key(p), marks_key(p), mark_positions_key(p), presence]
        reply = await self._claim(keys=keys, args=list(fields)) if fields else []
        if not fields:
            await self.client.set(presence, b"1")
        out: dict[str, Claim] = {}
        for i, field in enumerate(fields):
            token, mark, position = reply[3 * i : 3 * i + 3]
            out[field] = Claim(int(token), _int_or_none(mark), _int_or_none(position))
        return out

    async def sample(self, usage_fields: Sequence[str]) -> tuple[int, list[int | None]]:
        """The Redis clock (ms) and the usage marks at that instant (:data:`SAMPLE`)."""
        if not usage_fields:
            return await self.now_ms(), []
        reply = await self._sample(keys=[marks_key(self.prefix)], args=list(usage_fields))
        marks = [_int_or_none(m) for m in reply[1:]]
        return int(reply[0]), marks

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


def _mark_args(marks: Iterable[MarkWrite]) -> list[str | int]:
    args: list[str | int] = []
    for m in marks:
        w = "" if m.watermark_ms is None else m.watermark_ms
        args += [m.field, m.token, w, _arg(m.behind), _arg(m.position)]
    return args


def _arg(value: int | None) -> int | str:
    return "" if value is None else value


def _int_or_none(raw: bytes | str) -> int | None:
    return None if raw in (b"", "") else int(raw)


def _mark_reply(reply: Sequence[int]) -> MarkReply:
    present, written, fenced = (int(x) for x in reply)
    return MarkReply(bool(present), written, fenced)


def _score_arg(score: float | None) -> str:
    return "" if score is None else f"{score:.6f}"


def _absorb_args(
    window: bytes | None,
    spec: WindowSpec,
    version: int | None,
    rids: list[str],
    score: float | None = None,
) -> list[bytes | str | int]:
    """One key's :data:`ABSORB` ARGV entries."""
    # Idle longer than this, every bucket has aged out of the window: its PX.
    px = 2 * spec.window_ms
    version_arg = "" if version is None else version
    return [window or b"", px, version_arg, _score_arg(score), len(rids), *rids]
