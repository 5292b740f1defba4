"""The admission Lua scripts: one script per atomic decision."""

from __future__ import annotations

from dataclasses import dataclass, fields

from spendgate.admission.burst_lua import BURST_LUA_LIB
from spendgate.admission.window_lua import WINDOW_LUA_LIB

__all__ = [
    "ADMIT",
    "ADMIT_ARGS_PER_TARGET",
    "ADMIT_HEADER_ARGS",
    "ADMIT_HEADER_KEYS",
    "ADMIT_KEYS_PER_TARGET",
    "ADMIT_REPLY_PER_TARGET",
    "CLAIM_UNPUBLISHED",
    "EXTEND",
    "EXTEND_ARGS_PER_TARGET",
    "EXTEND_HEADER_KEYS",
    "EXTEND_KEYS_PER_TARGET",
    "EXTEND_REPLY_PER_TARGET",
    "SETTLE",
    "AdmitHeader",
    "AdmitTarget",
    "TargetTemplate",
    "encode_deps",
]

ArgValue = int | str


@dataclass(frozen=True, slots=True)
class AdmitHeader:
    """The ARGV entries of :data:`ADMIT` before the first plan, in ARGV order.

    Attributes:
        read_only: evaluate plan 1 only, reserve and store nothing.
        reservation_id: the id the reservation gets when one is made.
        idempotency_ttl_ms: how long the stored answer of the request id lives.
        record_ttl_ms: how long the reservation record lives.
        estimate_output_tokens: the estimate's output tokens (what ``cap`` lowers).
        estimate_json: the estimate as sent (JSON), kept in the reservation record so
            its ``reserve`` event can be rebuilt (``admission.reserves``).
        plans: how many plans follow.
        staleness_ms: a mark older than this (Redis clock) is stale.
        marks: the mark fields (``schemas.shards``) the targets' ``deps`` refer to; they
            follow this header in ARGV, before the first plan.
    """

    read_only: bool
    reservation_id: str
    idempotency_ttl_ms: int
    record_ttl_ms: int
    estimate_output_tokens: int
    estimate_json: str
    plans: int
    staleness_ms: int
    marks: tuple[str, ...]

    def argv(self) -> list[ArgValue]:
        """The entries, encoded as the script reads them."""
        return [
            int(self.read_only),
            self.reservation_id,
            self.idempotency_ttl_ms,
            self.record_ttl_ms,
            self.estimate_output_tokens,
            self.estimate_json,
            self.plans,
            self.staleness_ms,
            len(self.marks),
            *self.marks,
        ]


@dataclass(frozen=True, slots=True)
class AdmitTarget:
    """The ARGV entries of one budget key of a plan in :data:`ADMIT`, in ARGV order.

    ``on_exceed``: 0 reject, 1 cap, 2 downgrade or route; ``downgrade_plan``: the 1-based index of
    the plan to try when this key refuses (0 none); the amount at ``o`` output tokens is
    ``ceil((cap_s + o * cap_r) / cap_d)``; ``deps``: the 1-based indexes into the header's
    ``marks`` this key's window depends on; ``failure``: the policy's failure mode, 0
    closed, 1 open, 2 degraded (what an unvouched window means); ``burst``: the policy's
    token bucket as ``rate:per_ms:capacity`` (``schemas.burst.BurstSpec.encode``), ``""``
    for none (a target with one has a fourth key, the bucket's state).
    """

    limit: int
    window_ms: int
    bucket_ms: int
    boundary: str
    amount: int
    reservation_ttl_ms: int
    observe: bool
    on_exceed: int
    downgrade_plan: int
    cap_s: int
    cap_r: int
    cap_d: int
    deps: tuple[int, ...]
    failure: int
    burst: str = ""

    def argv(self) -> list[ArgValue]:
        """The entries, encoded as the script reads them."""
        return [
            self.limit,
            self.window_ms,
            self.bucket_ms,
            self.boundary,
            self.amount,
            self.reservation_ttl_ms,
            int(self.observe),
            self.on_exceed,
            self.downgrade_plan,
            self.cap_s,
            self.cap_r,
            self.cap_d,
            encode_deps(self.deps),
            self.failure,
            self.burst,
        ]


@dataclass(frozen=True, slots=True)
class TargetTemplate:
    """:class:`AdmitTarget` with the entries that depend only on the policy encoded once.

    Built once per policy version; :meth:`argv` fills in what each request brings and
    gives exactly ``AdmitTarget(...).argv()`` for the same values (a test checks it).
    """

    head: tuple[ArgValue, ...]
    middle: tuple[ArgValue, ...]
    failure: int
    burst: str = ""

    @classmethod
    def of(
        cls,
        *,
        limit: int,
        window_ms: int,
        bucket_ms: int,
        boundary: str,
        reservation_ttl_ms: int,
        observe: bool,
        on_exceed: int,
        failure: int,
        burst: str = "",
    ) -> TargetTemplate:
        """The template of one policy (the same fields as :class:`AdmitTarget`)."""
        return cls(
            (limit, window_ms, bucket_ms, boundary),
            (reservation_ttl_ms, int(observe), on_exceed),
            failure,
            burst,
        )

    def argv(
        self,
        amount: int,
        downgrade_plan: int,
        cap_s: int,
        cap_r: int,
        cap_d: int,
        deps: str,
    ) -> list[ArgValue]:
        """The entries of one target; ``deps`` already joined (:func:`encode_deps`)."""
        return [
            *self.head,
            amount,
            *self.middle,
            downgrade_plan,
            cap_s,
            cap_r,
            cap_d,
            deps,
            self.failure,
            self.burst,
        ]


def encode_deps(deps: tuple[int, ...]) -> str:
    """The ``deps`` entry of a target: the mark indexes, comma-separated."""
    return ",".join(str(d) for d in deps)


#: ARGV entries before the mark fields in :data:`ADMIT` (``marks`` is sent as its count).
ADMIT_HEADER_ARGS = len(fields(AdmitHeader)) + 1
#: ARGV entries per budget key in :data:`ADMIT`.
ADMIT_ARGS_PER_TARGET = len(fields(AdmitTarget))
#: KEYS entries before the first target in :data:`ADMIT`: the request's answer, the
#: reservation record, the unpublished reserves, the applied marks.
ADMIT_HEADER_KEYS = 4
#: KEYS entries per budget key in :data:`ADMIT`: window, pending window, pending reservations
#: (and a fourth, the token bucket, for a key whose policy has a ``burst``).
ADMIT_KEYS_PER_TARGET = 3
#: Reply entries per budget key of the reported plan.
ADMIT_REPLY_PER_TARGET = 6

# Check every matching budget key and reserve on all of them, or on none.
#
# A request is described by one or more *plans*: plan 1 is the subject as sent; plans
# 2.. are alternatives: the same request with the model replaced by a policy's
# ``downgrade_to`` or the pool by its ``route_to`` (their own matching policies and
# amounts). A plan is tried as a whole; alternatives are only tried when every refusal in
# plan 1 comes from policies offering one, in the order those keys come in plan 1 (the
# first that decides wins), and an alternative never falls back on another of its own.
#
# KEYS[1]              idempotency record of this request_id (the stored answer)
# KEYS[2]              the reservation record (hash: subject, plan, settled, and the
#                      reserve event's usage, at, out, ttl; see schemas/redis_keys.py)
# KEYS[3]              the unpublished reserves (sorted set: reservation id -> ms)
# KEYS[4]              the applied marks (hash: partition mark -> watermark ms, written
#                      by the worker; see schemas/shards.py)
# KEYS[5..]            for each plan in order, for each of its targets, 3 keys: the
#                      window (a string in the schemas.window_codec layout, written by the
#                      stream processor), the pending window (hash: a bucket's last ms ->
#                      amount pending there) and the pending reservations (hash:
#                      reservation id -> "field:amount", where it sits in the pending
#                      window), see schemas/redis_keys.py; a target whose burst entry
#                      is not empty has a 4th key: its token bucket (string
#                      "level:at_ms", see schemas/burst.py; missing = full)
# ARGV (encoded by AdmitHeader and AdmitTarget above):
# ARGV[1] read-only (1: evaluate plan 1, reserve and store nothing, ignore KEYS[1])
# ARGV[2] reservation id      ARGV[3] idempotency ttl ms   ARGV[4] record ttl ms
# ARGV[5] the estimate's output tokens (for cap)           ARGV[6] the estimate (JSON)
# ARGV[7] number of plans     ARGV[8] staleness bound ms     ARGV[9] m, number of marks
# ARGV[10..9+m] the mark fields the targets depend on
# per plan: subject JSON (stored in the record), n targets, then per target 15 entries:
#   limit, window_ms, bucket_ms, boundary, amount, reservation ttl ms (only the reserve
#   event's expires_at uses it: a pending amount ages out with its bucket, expired or
#   not), observe (0/1), on_exceed (0 reject, 1 cap, 2 try the alternative:
#   downgrade or route), alternative plan index (0 none), cap_s, cap_r, cap_d: the
#   amount at o output tokens is ceil((cap_s + o*cap_r) / cap_d) (cap_r = 0: capping
#   output does not lower this amount),
#   deps (comma-separated indexes of the marks the window depends on), failure (0 closed,
#   1 open, 2 degraded), burst ("rate:per_ms:capacity" or "" for none)
# Returns {replayed (0/1), outcome (0 reject, 1 allow, 2 cap, 3 observe_reject,
#          5 unvouched), now_ms,
#          retry_after_ms (-1 none, -2 never fits), reservation id, plan index,
#          max output tokens (-1 none), n, then per target of the reported plan:
#          used, reserved by others, own (reserved by this request), violated (0/1),
#          reset_after_ms, state (0 vouched, 1 stale, 2 missing),
#          then b, the reported plan's targets with a burst, and per such target:
#          its index (1-based), whole tokens left, ms until the bucket is full}
#
# Burst: a key's token bucket is checked beside its window on the same amount: a key
# refuses when either does, its Retry-After is when both fit (the bucket's refill is
# exact), and a reservation takes its amount from the bucket in the same write. A key
# without a burst reads and writes nothing more.
#
# State that cannot be vouched for: a key whose marks are missing (Redis lost its data and
# the worker has not restored and caught up) or older than the staleness bound (its
# worker is dead or behind) is decided by its policy's failure mode, here in the same
# atomic step: ``open`` keys do not refuse (they still hold the reservation), ``closed``
# and ``degraded`` keys make the outcome ``unvouched`` (nothing reserved; the caller
# answers from the failure mode). Observe keys never refuse, so their state only shows.
# An answer that reserved is stored and a repeat returns it verbatim; a reject holds
# nothing and is decided anew. Time is the Redis server clock (TIME), never the caller's.
#
# A reservation carries its own reserve event: the record keeps what the event is rebuilt
# from (byte for byte, same event id) and the reservation id joins the unpublished
# reserves, scored by its admission instant, in this same atomic step. The admission
# process removes it once Kafka acked the reserve; until then any admission process may
# republish it past a grace period (admission.sweeper), so a reservation whose process
# died before its reserve reached Kafka still reaches the worker. One ZADD per request:
# the work per budget key is unchanged.
#
# Usage = the absorbed window + the pending window, added bucket by bucket: a reservation
# sits in the bucket of its admission instant and ages out of the window like absorbed
# usage, so a Retry-After is at most window + bucket. "used" is the absorbed total,
# "reserved by others" what the pending window adds to it. The pending window is read
# whole (O(buckets in the window)), never one reservation at a time; the reservation
# record beside it is only written here and read by the processor's absorb.
ADMIT = (
    WINDOW_LUA_LIB
    + BURST_LUA_LIB
    + r"""
local read_only = ARGV[1] == '1'
if not read_only then
  local stored = redis.call('GET', KEYS[1])
  if stored then
    local out = {1}
    for v in string.gmatch(stored, '([^,]+)') do out[#out + 1] = v end
    return out
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[2]
local est_out = tonumber(ARGV[5])
local nplans = tonumber(ARGV[7])
local nmarks = tonumber(ARGV[9])
local mark_state = {}
if nmarks > 0 then
  local names = {}
  for i = 1, nmarks do names[i] = ARGV[9 + i] end
  local seen = redis.call('HMGET', KEYS[4], unpack(names))
  local oldest = now - tonumber(ARGV[8])
  for i = 1, nmarks do
    if not seen[i] then
      mark_state[i] = 2
    elseif tonumber(seen[i]) < oldest then
      mark_state[i] = 1
    else
      mark_state[i] = 0
    end
  end
end

-- Parse every plan; window state is read only for the plans evaluated.
local plans, a, k = {}, 10 + nmarks, 5
for p = 1, nplans do
  local plan = {subject = ARGV[a], n = tonumber(ARGV[a + 1]), targets = {}}
  a = a + 2
  for j = 1, plan.n do
    plan.targets[j] = {
      wkey = KEYS[k], pwkey = KEYS[k + 1], prkey = KEYS[k + 2],
      limit = tonumber(ARGV[a]), window = tonumber(ARGV[a + 1]),
      bucket = tonumber(ARGV[a + 2]), boundary = ARGV[a + 3],
      amount = tonumber(ARGV[a + 4]), ttl = tonumber(ARGV[a + 5]),
      observe = ARGV[a + 6] == '1', on_exceed = tonumber(ARGV[a + 7]),
      alt = tonumber(ARGV[a + 8]), cap_s = tonumber(ARGV[a + 9]),
      cap_r = tonumber(ARGV[a + 10]), cap_d = tonumber(ARGV[a + 11]),
      failure = tonumber(ARGV[a + 13]), state = 0,
    }
    for d in string.gmatch(ARGV[a + 12], '%d+') do
      local st = mark_state[tonumber(d)]
      if st > plan.targets[j].state then plan.targets[j].state = st end
    end
    k = k + 3
    if ARGV[a + 14] ~= '' then
      local x = plan.targets[j]
      x.brate, x.bper, x.bcap = burst_parse(ARGV[a + 14])
      x.bkey = KEYS[k]
      k = k + 1
    end
    a = a + 15
  end
  plans[p] = plan
end

local function load(plan)
  if plan.loaded then return end
  plan.loaded = true
  for j = 1, plan.n do
    local x = plan.targets[j]
    local absorbed, pending
    x.starts, x.amounts, x.count, absorbed, pending, x.stale = window_combine(
      redis.call('GET', x.wkey), redis.call('HGETALL', x.pwkey), now, x.window, x.bucket,
      x.boundary)
    -- Refunds larger than the charges they correct never create extra room.
    x.used = absorbed
    if x.used < 0 then x.used = 0 end
    x.reserved = pending
    x.wviolated = x.used + x.reserved + x.amount > x.limit
    -- An unvouched window of a policy that fails open never refuses.
    if x.state > 0 and x.failure == 1 then x.wviolated = false end
    x.violated = x.wviolated
    if x.brate then
      -- The bucket is admission's own state, never unvouched.
      x.blevel, x.bfits, x.bwait, x.bnever = burst_check(redis.call('GET', x.bkey), x.brate,
                                                          x.bper, x.bcap, now, x.amount)
      if not x.bfits then x.violated = true end
    end
    x.own = 0
  end
end

-- Milliseconds until every amount counted now (absorbed and pending) has aged out,
-- assuming no new usage and this request's reservation in the current bucket.
local function reset_after(x)
  return window_reset_after(x.starts, x.amounts, x.count, now, x.window, x.bucket, x.boundary,
                            x.own)
end

-- Earliest wait (ms) until every refusing enforce key (or observe key) fits the estimate,
-- with absorbed and pending amounts aging out of the window alike.
local function retry_of(plan, observe)
  local retry = -1
  for j = 1, plan.n do
    local x = plan.targets[j]
    if x.violated and x.observe == observe then
      local wait = 0
      if x.wviolated then
        local at, never = window_retry_after(x.starts, x.amounts, x.count, now, x.window,
                                             x.bucket, x.boundary, x.limit, 0, x.amount)
        if never then
          wait = -2
        elseif at then
          wait = at - now
        else
          -- Unreachable with non-negative usage: everything has aged out by then.
          wait = x.window + x.bucket
        end
      end
      if x.brate and not x.bfits then
        if x.bnever then wait = -2 elseif wait ~= -2 and x.bwait > wait then wait = x.bwait end
      end
      if wait == -2 or retry == -2 then retry = -2 elseif wait > retry then retry = wait end
    end
  end
  return retry
end

local function capped_amount(x, o)
  local v = x.cap_s + o * x.cap_r
  local m = math.fmod(v, x.cap_d)
  local q = (v - m) / x.cap_d
  if m > 0 then q = q + 1 end
  return q
end

-- Largest output (<= est_out) at which every enforce key fits, or -1.
local function cap_output(plan)
  local best = est_out
  for j = 1, plan.n do
    local x = plan.targets[j]
    if not x.observe then
      local room = x.limit - x.used - x.reserved
      if x.brate then
        local tokens = (x.blevel - math.fmod(x.blevel, x.bper)) / x.bper
        if tokens < room then room = tokens end
      end
      if x.cap_r == 0 then
        if x.amount > room then return -1 end
      elseif room * x.cap_d < 9007199254740992 then
        local v = room * x.cap_d - x.cap_s
        if v < 0 then return -1 end
        local o = (v - math.fmod(v, x.cap_r)) / x.cap_r
        if o < best then best = o end
      end
    end
  end
  if best < 1 then return -1 end
  return best
end

-- Returns outcome (0 reject, 1 allow, 2 cap, 3 observe_reject, 4 try the alternatives,
-- 5 unvouched), value (max output for cap, the alternative plan indexes in order for 4).
local function evaluate(plan, may_downgrade)
  load(plan)
  if not read_only then
    for j = 1, plan.n do
      local x = plan.targets[j]
      if x.state > 0 and not x.observe and x.failure ~= 1 then return 5, -1 end
    end
  end
  local hard, capv, obs, alts, seen = false, false, false, {}, {}
  for j = 1, plan.n do
    local x = plan.targets[j]
    if x.violated then
      if x.observe then
        obs = true
      elseif x.on_exceed == 1 then
        capv = true
      elseif x.on_exceed == 2 and may_downgrade and x.alt > 0 then
        if not seen[x.alt] then
          seen[x.alt] = true
          alts[#alts + 1] = x.alt
        end
      else
        hard = true
      end
    end
  end
  if hard then return 0, -1 end
  if #alts > 0 then return 4, alts end
  if capv then
    local o = cap_output(plan)
    if o < 0 then return 0, -1 end
    for j = 1, plan.n do
      local x = plan.targets[j]
      if x.cap_r > 0 then x.own = capped_amount(x, o) else x.own = x.amount end
    end
    return 2, o
  end
  for j = 1, plan.n do plan.targets[j].own = plan.targets[j].amount end
  if obs then return 3, -1 end
  return 1, -1
end

local chosen, outcome, value = 1, evaluate(plans[1], not read_only)
if outcome == 4 then
  local alts = value
  outcome, value = 0, -1
  for i = 1, #alts do
    local alt_outcome, alt_value = evaluate(plans[alts[i]], false)
    if alt_outcome ~= 0 then
      chosen, outcome, value = alts[i], alt_outcome, alt_value
      break
    end
  end
end
local plan = plans[chosen]
local retry = -1
if outcome == 0 or outcome == 5 then
  if outcome == 0 then retry = retry_of(plan, false) end
  for j = 1, plan.n do plan.targets[j].own = 0 end
elseif outcome == 3 then
  retry = retry_of(plan, true)
end
local max_out = -1
if outcome == 2 then max_out = value end

local answer = {outcome, now, retry, rid, chosen, max_out, plan.n}
for j = 1, plan.n do
  local x = plan.targets[j]
  answer[#answer + 1] = x.used
  answer[#answer + 1] = x.reserved
  answer[#answer + 1] = x.own
  answer[#answer + 1] = x.violated and 1 or 0
  answer[#answer + 1] = reset_after(x)
  answer[#answer + 1] = x.state
end
local nb, bpos = 0, #answer + 1
answer[bpos] = 0
for j = 1, plan.n do
  local x = plan.targets[j]
  if x.brate then
    local left, full_ms
    if x.own > 0 and not read_only then
      left, full_ms = burst_take(x.blevel, x.brate, x.bper, x.bcap, x.own)
      x.bleft, x.bttl = left, full_ms
    else
      left, full_ms = burst_take(x.blevel, x.brate, x.bper, x.bcap, 0)
    end
    nb = nb + 1
    answer[#answer + 1] = j
    answer[#answer + 1] = (left - math.fmod(left, x.bper)) / x.bper
    answer[#answer + 1] = full_ms
  end
end
answer[bpos] = nb
if outcome ~= 0 and outcome ~= 5 and not read_only then
  for j = 1, plan.n do
    local x = plan.targets[j]
    for i = 1, #x.stale, 1000 do
      redis.call('HDEL', x.pwkey, unpack(x.stale, i, math.min(i + 999, #x.stale)))
    end
    if x.own > 0 then
      -- Pending until the processor absorbs the reserve event; once its bucket has left
      -- the window it no longer counts, so both hashes live that long past the last write.
      local field = string.format('%d', now - window_mod(now, x.bucket) + x.bucket - 1)
      redis.call('HINCRBY', x.pwkey, field, string.format('%d', x.own))
      redis.call('HSET', x.prkey, rid, field .. ':' .. string.format('%d', x.own))
      redis.call('PEXPIRE', x.pwkey, x.window + x.bucket)
      redis.call('PEXPIRE', x.prkey, x.window + x.bucket)
    end
    if x.bleft then
      redis.call('SET', x.bkey, string.format('%d:%d', x.bleft, now), 'PX',
                 string.format('%d', x.bttl))
    end
  end
  local ttl = 0
  for j = 1, plan.n do
    if plan.targets[j].ttl > ttl then ttl = plan.targets[j].ttl end
  end
  local at = string.format('%d', now)
  redis.call('HSET', KEYS[2], 'subject', plan.subject, 'plan', chosen, 'usage', ARGV[6],
             'at', at, 'out', string.format('%d', max_out), 'ttl', string.format('%d', ttl))
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
  redis.call('ZADD', KEYS[3], at, rid)
  redis.call('SET', KEYS[1], window_join(answer), 'PX', tonumber(ARGV[3]))
end
local out = {0}
for i = 1, #answer do out[#out + 1] = answer[i] end
return out
"""
)

#: KEYS entries before the first target in :data:`EXTEND`.
EXTEND_HEADER_KEYS = 3
#: KEYS entries per budget key in :data:`EXTEND`: window, pending window, pending reservations.
EXTEND_KEYS_PER_TARGET = 3
#: ARGV entries per budget key in :data:`EXTEND`.
EXTEND_ARGS_PER_TARGET = 8
#: Reply entries per budget key of :data:`EXTEND`.
EXTEND_REPLY_PER_TARGET = 6

# Grow an open reservation on every budget key it holds, or on none (a streaming extend).
#
# The amount is charged at the extend's own instant (the Redis clock): it joins the pending
# window in the bucket of now, under its own pending entry (the extend's event id), which
# the processor absorbs when it applies the extend event, as it absorbs a reserve. Work
# per budget key is that of an admit: O(buckets in the window).
#
# KEYS[1] the extend's stored answer (one per reservation and sequence number)
# KEYS[2] the reservation record (hash written by ADMIT: must exist and not be settled)
# KEYS[3] the applied marks (hash: partition mark -> watermark ms)
# KEYS[4..] per target 3 keys: window, pending window, pending reservations (as in ADMIT)
# ARGV[1] the pending entry's name (the extend event's id)   ARGV[2] answer ttl ms
# ARGV[3] staleness bound ms   ARGV[4] m, number of marks   ARGV[5..4+m] the mark fields
# ARGV[5+m] n targets, then per target 8 entries: limit, window_ms, bucket_ms, boundary,
#   amount, observe (0/1), failure (0 closed, 1 open, 2 degraded), deps (comma-separated
#   mark indexes)
# Returns {replayed (0/1), outcome (0 reject, 1 allow, 5 unvouched, 6 no such open
#          reservation, 7 already settled), now_ms (the extend's instant), n, then per
#          target: used, reserved (pending, this extend excluded), own (this extend),
#          violated (0/1), reset_after_ms, state (0 vouched, 1 stale, 2 missing)}: the
#          layout of ADMIT's per-target reply
# An allow is stored (a repeat of the same sequence number returns it, growing nothing);
# a refusal holds nothing and is decided anew.
EXTEND = (
    WINDOW_LUA_LIB
    + r"""
local stored = redis.call('GET', KEYS[1])
if stored then
  local out = {1}
  for v in string.gmatch(stored, '([^,]+)') do out[#out + 1] = v end
  return out
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('EXISTS', KEYS[2]) == 0 then return {0, 6, now, 0} end
if redis.call('HGET', KEYS[2], 'settled') then return {0, 7, now, 0} end
local nmarks = tonumber(ARGV[4])
local mark_state = {}
if nmarks > 0 then
  local names = {}
  for i = 1, nmarks do names[i] = ARGV[4 + i] end
  local seen = redis.call('HMGET', KEYS[3], unpack(names))
  local oldest = now - tonumber(ARGV[3])
  for i = 1, nmarks do
    if not seen[i] then mark_state[i] = 2
    elseif tonumber(seen[i]) < oldest then mark_state[i] = 1
    else mark_state[i] = 0 end
  end
end
local n = tonumber(ARGV[5 + nmarks])
local a, k = 6 + nmarks, 4
local targets = {}
local refused, unvouched = false, false
for j = 1, n do
  local x = {
    wkey = KEYS[k], pwkey = KEYS[k + 1], prkey = KEYS[k + 2],
    limit = tonumber(ARGV[a]), window = tonumber(ARGV[a + 1]), bucket = tonumber(ARGV[a + 2]),
    boundary = ARGV[a + 3], amount = tonumber(ARGV[a + 4]), observe = ARGV[a + 5] == '1',
    failure = tonumber(ARGV[a + 6]), state = 0,
  }
  for d in string.gmatch(ARGV[a + 7], '%d+') do
    local st = mark_state[tonumber(d)]
    if st > x.state then x.state = st end
  end
  local absorbed, pending
  x.starts, x.amounts, x.count, absorbed, pending, x.stale = window_combine(
    redis.call('GET', x.wkey), redis.call('HGETALL', x.pwkey), now, x.window, x.bucket,
    x.boundary)
  x.used = absorbed
  if x.used < 0 then x.used = 0 end
  x.reserved = pending
  x.violated = x.used + x.reserved + x.amount > x.limit
  if x.state > 0 and x.failure == 1 then x.violated = false end
  if x.state > 0 and not x.observe and x.failure ~= 1 then unvouched = true end
  if x.violated and not x.observe then refused = true end
  targets[j] = x
  a = a + 8
  k = k + 3
end
local outcome = 1
if unvouched then outcome = 5 elseif refused then outcome = 0 end
local answer = {outcome, now, n}
for j = 1, n do
  local x = targets[j]
  local own = 0
  if outcome == 1 then own = x.amount end
  answer[#answer + 1] = x.used
  answer[#answer + 1] = x.reserved
  answer[#answer + 1] = own
  answer[#answer + 1] = x.violated and 1 or 0
  answer[#answer + 1] = window_reset_after(x.starts, x.amounts, x.count, now, x.window,
                                          x.bucket, x.boundary, own)
  answer[#answer + 1] = x.state
end
if outcome == 1 then
  for j = 1, n do
    local x = targets[j]
    for i = 1, #x.stale, 1000 do
      redis.call('HDEL', x.pwkey, unpack(x.stale, i, math.min(i + 999, #x.stale)))
    end
    if x.amount > 0 then
      local field = string.format('%d', now - window_mod(now, x.bucket) + x.bucket - 1)
      redis.call('HINCRBY', x.pwkey, field, string.format('%d', x.amount))
      redis.call('HSET', x.prkey, ARGV[1], field .. ':' .. string.format('%d', x.amount))
      redis.call('PEXPIRE', x.pwkey, x.window + x.bucket)
      redis.call('PEXPIRE', x.prkey, x.window + x.bucket)
    end
  end
  redis.call('SET', KEYS[1], window_join(answer), 'PX', tonumber(ARGV[2]))
end
local out = {0}
for i = 1, #answer do out[#out + 1] = answer[i] end
return out
"""
)

# Settle an open reservation once: a commit or a release, never both.
#
# KEYS[1] the reservation record (hash written by ADMIT)
# ARGV[1] kind: "commit" or "release"
# Returns {status, subject JSON}: status "missing" (no such record: expired or never
# held), "ok" (first settle, or a repeat of the same kind), or "conflict:<kind>" when
# the reservation was already settled the other way.
SETTLE = r"""
local subject = redis.call('HGET', KEYS[1], 'subject')
if not subject then return {'missing', ''} end
local settled = redis.call('HGET', KEYS[1], 'settled')
if settled and settled ~= ARGV[1] then return {'conflict:' .. settled, subject} end
if not settled then redis.call('HSET', KEYS[1], 'settled', ARGV[1]) end
return {'ok', subject}
"""

# Claim the unpublished reserves older than a grace period, for republishing.
#
# KEYS[1] the unpublished reserves (sorted set: reservation id -> ms, see ADMIT)
# ARGV[1] grace ms            ARGV[2] most entries to claim
# ARGV[3] the cutoff this sweep's first claim returned, or "" for a sweep's first claim
# Returns {cutoff, claimed reservation ids oldest first...}: the entries scored before the
# cutoff (now - grace on the first claim of a sweep, kept for the rest of that sweep).
# A claimed entry is re-scored to now: no other process claims it again before another
# grace period has passed, by which time this one has published it (and removed it on the
# broker's ack) or died, in which case the next claim republishes it; and the same sweep
# never takes it twice, since now is never before the sweep's cutoff. Time is the Redis
# server clock, the same clock that scored the entries.
CLAIM_UNPUBLISHED = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - tonumber(ARGV[1])
if ARGV[3] ~= '' then cutoff = tonumber(ARGV[3]) end
cutoff = string.format('%d', cutoff)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. cutoff, 'LIMIT', 0,
                       tonumber(ARGV[2]))
local stamp = string.format('%d', now)
for i = 1, #ids, 500 do
  local args = {}
  for j = i, math.min(i + 499, #ids) do
    args[#args + 1] = stamp
    args[#args + 1] = ids[j]
  end
  redis.call('ZADD', KEYS[1], 'XX', unpack(args))
end
table.insert(ids, 1, cutoff)
return ids
"""
