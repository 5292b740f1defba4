-- ADMIT: check every matching budget key and reserve on all of them, or on none.
-- Contract: spendgate.admission.scripts.admit
--
-- A request is described by one or more plans: plan 1 is the subject as sent; plans 2.. are
-- alternatives: the same request with the model replaced by a policy's downgrade_to or the
-- pool by its route_to (their own matching policies and amounts). A plan is tried as a
-- whole; alternatives are only tried when every refusal in plan 1 comes from policies
-- offering one, in the order those keys come in plan 1 (the first that decides wins), and an
-- alternative never falls back on another of its own.
--
-- Burst: a key's token bucket is checked beside its window on the same amount: a key refuses
-- when either does, its Retry-After is when both fit (the bucket's refill is exact), and a
-- reservation takes its amount from the bucket in the same write. A key without a burst
-- reads and writes nothing more.
--
-- State that cannot be vouched for: a key whose marks are missing (Redis lost its data and
-- the worker has not restored and caught up) or older than the staleness bound (its worker
-- is dead or behind) is decided by its policy's failure mode, here in the same atomic step:
-- open keys do not refuse (they still hold the reservation), closed and degraded keys make
-- the outcome unvouched (nothing reserved; the caller answers from the failure mode).
-- Observe keys never refuse, so their state only shows. An answer that reserved is stored
-- and a repeat returns it verbatim; a reject holds nothing and is decided anew. Time is the
-- Redis server clock (TIME), never the caller's.
--
-- A reservation carries its own reserve event: the record keeps what the event is rebuilt
-- from (byte for byte, same event id) and the reservation id joins the unpublished reserves,
-- scored by its admission instant, in this same atomic step. The admission process removes
-- it once Kafka acked the reserve; until then any admission process may republish it past a
-- grace period (admission.sweeper). One ZADD per request: the work per budget key is
-- unchanged.
--
-- Usage = the absorbed window + the pending window, added bucket by bucket: a reservation
-- sits in the bucket of its admission instant and ages out of the window like absorbed
-- usage, so a Retry-After is at most window + bucket. "used" is the absorbed total,
-- "reserved by others" what the pending window adds to it. Both are read in O(1) per key
-- (key_steps: prefix sums of the absorbed window, the pending window's running sum and
-- queue), never one bucket or one reservation at a time; a refusal's Retry-After is a
-- binary search over the window's periods when the total can only fall.
--
-- KEYS (4, then 6 or 7 per target of each plan, in plan order)
--   answer        the stored answer of this request id (schemas/redis_values.py; a
--                 piece: unused)
--   record        the reservation record (schemas/redis_values.py: ReservationRecord;
--                 a piece: its piece record)
--   unpublished   the unpublished reserves (sorted set: reservation id -> admission ms;
--                 a piece: the provisional set, reservation id -> deadline ms)
--   marks         the applied marks (hash: mark field -> watermark ms, by the worker)
--   per target:
--   window        the absorbed window (string, schemas/window_codec.py), by the worker
--   pending       the version-1 pending window (hash: a bucket's last ms -> amount)
--   pending v2    the version-2 pending window (hash: the same, plus their sum 't' and
--                 each reservation's pending entry under 'r:' + id)
--   queue         the version-2 pending window's bucket fields, oldest first (list)
--   reservations  the version-1 pending reservations (hash: reservation id -> pending
--                 entry)
--   expiry        the version-2 holds not yet absorbed, oldest first (list: "<due ms>:<entry
--                 name>", key_steps "Expiry")
--   bucket        only for a target with a burst: its token bucket ("level:at_ms",
--                 schemas/burst.py; missing = full)
-- ARGV (9 + m header entries, then per plan 2 + 15 per target)
--   mode            0 decide; 1 read-only: evaluate plan 1, reserve and store nothing,
--                   ignore the answer key; 2 piece: one shard's part of a request whose
--                   keys span shards (admission.shards): decide and hold as 0 does, but
--                   store no answer and no reserve of its own; a hold is listed instead
--                   in the provisional set (KEYS[3]) scored by its deadline, and KEYS[2]
--                   keeps the piece record (what its release needs)
--   reservation     the id a reservation made now gets
--   answer_ttl      ms the stored answer lives (a piece: ms until its deadline)
--   record_ttl      ms the reservation record lives (a piece: its piece record)
--   estimate_out    the estimate's output tokens (what cap lowers)
--   estimate        the estimate as sent (JSON, kept in the record; a piece: the piece
--                   record's text)
--   plans           the number of plans
--   staleness       ms: a mark older than this (Redis clock) is stale
--   m, then m mark fields the targets' deps refer to
--   per plan: subject (JSON, kept in the record), n targets, then per target:
--     limit, window_ms, bucket_ms, boundary (include | exclude | prorate), amount,
--     reservation_ttl_ms (the reserve event's expires_at only), observe (0/1),
--     on_exceed (codes.ON_EXCEED: 0 reject, 1 cap, 2 try the alternative), alternative plan
--     (1-based, 0 none), cap_s, cap_r, cap_d (the amount at o output tokens is
--     ceil((cap_s + o * cap_r) / cap_d); cap_r = 0: capping does not lower it),
--     deps (comma-separated 1-based mark indexes), failure (codes.FAILURE_MODES),
--     burst ("rate:per_ms:capacity", "" for none)
-- Reply
--   replayed (0/1), outcome (codes.OUTCOMES: 0 reject, 1 allow, 2 cap, 3 observe_reject,
--   5 unvouched), now_ms, retry_after_ms (-1 none, -2 never fits), reservation id, plan
--   (1-based), max output tokens (-1 none), n, then per target of the reported plan: used,
--   reserved by others, own, violated (0/1), reset_after_ms, state (codes.STATES); then b
--   and per target with a burst: its index (1-based), whole tokens left, ms until full.
--   A replayed answer is the stored one, every value as text.
--! include spendgate.schemas:window
--! include spendgate.schemas:window_view
--! include spendgate.schemas:burst
--! include spendgate.schemas:redis_values
--! include spendgate.admission.scripts:key_steps

local read_only = ARGV[1] == '1'
local piece = ARGV[1] == '2'
if not read_only and not piece then
  local stored = redis.call('GET', KEYS[1])
  if stored then return answer_decode(stored) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[2]
local est_out = tonumber(ARGV[5])
local nplans = tonumber(ARGV[7])
local nmarks = tonumber(ARGV[9])
local names = {}
for i = 1, nmarks do names[i] = ARGV[9 + i] end
local mark_state, mark_at = marks_states(KEYS[4], names, now, tonumber(ARGV[8]))

-- Parse every plan; window state is read only for the plans evaluated.
local unpublished = nil
if not piece and not read_only then unpublished = KEYS[3] end
local plans, a, k = {}, 10 + nmarks, 5
for p = 1, nplans do
  local plan = {subject = ARGV[a], n = tonumber(ARGV[a + 1]), targets = {}}
  a = a + 2
  for j = 1, plan.n do
    local state, mark = key_state(ARGV[a + 12], mark_state, mark_at)
    plan.targets[j] = {
      wkey = KEYS[k], pwkey = KEYS[k + 1], pvkey = KEYS[k + 2], pqkey = KEYS[k + 3],
      prkey = KEYS[k + 4], pekey = KEYS[k + 5],
      limit = tonumber(ARGV[a]), window = tonumber(ARGV[a + 1]),
      bucket = tonumber(ARGV[a + 2]), boundary = ARGV[a + 3],
      amount = tonumber(ARGV[a + 4]), ttl = tonumber(ARGV[a + 5]),
      observe = ARGV[a + 6] == '1', on_exceed = tonumber(ARGV[a + 7]),
      alt = tonumber(ARGV[a + 8]), cap_s = tonumber(ARGV[a + 9]),
      cap_r = tonumber(ARGV[a + 10]), cap_d = tonumber(ARGV[a + 11]),
      failure = tonumber(ARGV[a + 13]), state = state, mark = mark, repair = not read_only,
      -- A hold due for expiry whose reserve is not acked yet is held on: its reservation's
      -- own shard knows (a piece's does not; its hold expires when due).
      unpub = unpublished,
    }
    k = k + 6
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
    key_load(x, now)
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
  return key_reset_after(x, now, x.own)
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
        local at, never = key_retry_after(x, now)
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
    -- Pending until the worker absorbs the reserve event; once its bucket has left the
    -- window it no longer counts.
    key_hold(x, rid, x.own, now)
    if x.bleft then
      redis.call('SET', x.bkey, string.format('%d:%d', x.bleft, now), 'PX',
                 string.format('%d', x.bttl))
    end
  end
  local ttl = 0
  for j = 1, plan.n do
    if plan.targets[j].ttl > ttl then ttl = plan.targets[j].ttl end
  end
  if piece then
    redis.call('SET', KEYS[2], ARGV[6], 'PX', tonumber(ARGV[4]))
    redis.call('ZADD', KEYS[3], string.format('%d', now + tonumber(ARGV[3])), rid)
  else
    local at = string.format('%d', now)
    record_write(KEYS[2], plan.subject, chosen, ARGV[6], at, max_out, ttl, tonumber(ARGV[4]))
    redis.call('ZADD', KEYS[3], at, rid)
    redis.call('SET', KEYS[1], answer_encode(answer), 'PX', tonumber(ARGV[3]))
  end
end
local out = {0}
for i = 1, #answer do out[#out + 1] = answer[i] end
return out
