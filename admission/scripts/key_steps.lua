-- spendgate budget-key steps that ADMIT and EXTEND share.
-- Library: local functions only; it reads no script keys or arguments and sets no globals.
-- Needs spendgate.schemas:window and spendgate.schemas:redis_values included before it.
-- Provides:
--   marks_states(marks_key, names, now, staleness_ms) -> states: per mark field, 0 vouched,
--     1 stale (older than now - staleness_ms), 2 missing (codes.STATES)
--   key_state(deps, states) -> the worst state of the marks a key depends on (deps: the
--     comma-separated 1-based indexes into states)
--   key_load(x, now): read the key x (x.wkey, x.pwkey, x.window, x.bucket, x.boundary)
--     at now: x.starts, x.amounts, x.count (absorbed plus pending, bucket by bucket),
--     x.used (absorbed; a refund larger than what it corrects never makes room),
--     x.reserved (pending) and x.stale (pending fields that no longer count)
--   key_hold(x, entry, amount, now): prune x.stale, and when amount > 0 hold it in the
--     pending window in the bucket of now under the pending entry named entry; both hashes
--     live window + bucket past the last write

local function marks_states(marks_key, names, now, staleness_ms)
  local states = {}
  if #names == 0 then return states end
  local seen = redis.call('HMGET', marks_key, unpack(names))
  local oldest = now - staleness_ms
  for i = 1, #names do
    if not seen[i] then
      states[i] = 2
    elseif tonumber(seen[i]) < oldest then
      states[i] = 1
    else
      states[i] = 0
    end
  end
  return states
end

local function key_state(deps, states)
  local state = 0
  for d in string.gmatch(deps, '%d+') do
    local st = states[tonumber(d)]
    if st > state then state = st end
  end
  return state
end

local function key_load(x, now)
  local absorbed, pending
  x.starts, x.amounts, x.count, absorbed, pending, x.stale = window_combine(
    redis.call('GET', x.wkey), redis.call('HGETALL', x.pwkey), now, x.window, x.bucket,
    x.boundary)
  x.used = absorbed
  if x.used < 0 then x.used = 0 end
  x.reserved = pending
end

local function key_hold(x, entry, amount, now)
  for i = 1, #x.stale, 1000 do
    redis.call('HDEL', x.pwkey, unpack(x.stale, i, math.min(i + 999, #x.stale)))
  end
  if amount > 0 then
    local field = window_pending_field(now, x.bucket)
    redis.call('HINCRBY', x.pwkey, field, string.format('%d', amount))
    redis.call('HSET', x.prkey, entry, pending_entry_encode(field, amount))
    redis.call('PEXPIRE', x.pwkey, x.window + x.bucket)
    redis.call('PEXPIRE', x.prkey, x.window + x.bucket)
  end
end
