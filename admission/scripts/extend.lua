-- EXTEND: grow an open reservation on every budget key it holds, or on none (streaming).
-- Contract: spendgate.admission.scripts.extend
--
-- The amount is charged at the extend's own instant (the Redis clock): it joins the pending
-- window in the bucket of now, under its own pending entry (named by the extend's event
-- id), which the worker absorbs when it applies the extend event, as it absorbs a reserve.
-- Work per budget key is that of an admit: O(1) (key_steps). An allow is stored (a
-- repeat of the same sequence number returns it, growing nothing); a refusal holds nothing
-- and is decided anew.
--
-- KEYS (3, then 6 per target)
--   answer        the extend's stored answer (one per reservation and sequence number)
--   record        the reservation record (written by ADMIT: must exist, not be settled)
--   marks         the applied marks (hash: mark field -> watermark ms)
--   per target: window, pending, pending v2, queue, reservations, expiry (as in ADMIT)
-- ARGV (4 + m, then 1 + 9 per target, then the mode)
--   entry         the pending entry's name (the extend event's id)
--   answer_ttl    ms the stored answer lives
--   staleness     ms: a mark older than this (Redis clock) is stale
--   m, then m mark fields
--   n targets, then per target: limit, window_ms, bucket_ms, boundary, amount,
--     observe (0/1), failure (codes.FAILURE_MODES), deps (comma-separated mark indexes),
--     reservation_ttl_ms (this hold's expiry, key_steps "Expiry")
--   mode          "" an extend on one shard; "piece": one shard's part of an extend whose
--                 keys span shards (admission.pieces): decided and held as "" does, no
--                 answer read or stored, no record checked (answer and record keys
--                 unused); "seal" + the merged answer (schemas/redis_values.py): on the
--                 home shard, no targets: the record checked, the answer stored as given
--                 (a stored one is replayed instead)
-- Reply
--   replayed (0/1), outcome (codes.EXTEND_OUTCOMES: 0 reject, 1 allow, 5 unvouched, 6 no
--   such open reservation, 7 already settled), now_ms (the extend's instant), n, then per
--   target, as ADMIT's: used, reserved (pending, this extend excluded), own (this extend),
--   violated (0/1), reset_after_ms, state (codes.STATES)
--! include spendgate.schemas:window
--! include spendgate.schemas:window_view
--! include spendgate.schemas:redis_values
--! include spendgate.admission.scripts:key_steps

local nmarks = tonumber(ARGV[4])
local mode = ARGV[6 + nmarks + 9 * tonumber(ARGV[5 + nmarks])] or ''
local piece = mode == 'piece'
if not piece then
  local stored = redis.call('GET', KEYS[1])
  if stored then return answer_decode(stored) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not piece then
  if not record_subject(KEYS[2]) then return {0, 6, now, 0} end
  if record_settled(KEYS[2]) then return {0, 7, now, 0} end
end
if string.sub(mode, 1, 4) == 'seal' then
  redis.call('SET', KEYS[1], string.sub(mode, 5), 'PX', tonumber(ARGV[2]))
  return {0, 1, now, 0}
end
local names = {}
for i = 1, nmarks do names[i] = ARGV[4 + i] end
local mark_state, mark_at = marks_states(KEYS[3], names, now, tonumber(ARGV[3]))
local n = tonumber(ARGV[5 + nmarks])
local a, k = 6 + nmarks, 4
local targets = {}
local refused, unvouched = false, false
for j = 1, n do
  local x = {
    wkey = KEYS[k], pwkey = KEYS[k + 1], pvkey = KEYS[k + 2], pqkey = KEYS[k + 3],
    prkey = KEYS[k + 4], pekey = KEYS[k + 5],
    limit = tonumber(ARGV[a]), window = tonumber(ARGV[a + 1]), bucket = tonumber(ARGV[a + 2]),
    boundary = ARGV[a + 3], amount = tonumber(ARGV[a + 4]), observe = ARGV[a + 5] == '1',
    failure = tonumber(ARGV[a + 6]), ttl = tonumber(ARGV[a + 8]), repair = true,
  }
  x.state, x.mark = key_state(ARGV[a + 7], mark_state, mark_at)
  key_load(x, now)
  x.violated = x.used + x.reserved + x.amount > x.limit
  if x.state > 0 and x.failure == 1 then x.violated = false end
  if x.state > 0 and not x.observe and x.failure ~= 1 then unvouched = true end
  if x.violated and not x.observe then refused = true end
  targets[j] = x
  a = a + 9
  k = k + 6
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
  answer[#answer + 1] = key_reset_after(x, now, own)
  answer[#answer + 1] = x.state
end
if outcome == 1 then
  for j = 1, n do
    key_hold(targets[j], ARGV[1], targets[j].amount, now)
  end
  if not piece then redis.call('SET', KEYS[1], answer_encode(answer), 'PX', tonumber(ARGV[2])) end
end
local out = {0}
for i = 1, #answer do out[#out + 1] = answer[i] end
return out
