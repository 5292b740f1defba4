"""The admission Lua scripts: one script per atomic decision."""

from __future__ import annotations

from admission.window_lua import WINDOW_LUA_LIB

__all__ = ["ADMIT", "ADMIT_ARGS_PER_TARGET"]

#: ARGV entries per budget key in :data:`ADMIT`.
ADMIT_ARGS_PER_TARGET = 6

# Check every matching budget key and reserve on all of them, or on none.
#
# KEYS[1]              idempotency record of this request_id
# KEYS[2j], KEYS[2j+1] for target j = 1..n: the window (a string in the
#                      schemas.window_codec layout, written by the stream processor) and
#                      the pending hash (reservation id -> "amount:expires_ms", written here)
# ARGV[1] n, ARGV[2] reservation id, ARGV[3] idempotency ttl ms
# ARGV[4 + 6(j-1) ...] for target j: limit, window_ms, bucket_ms, boundary, amount,
#                      reservation ttl ms
# Returns {replayed (0/1), allowed (0/1), now_ms, retry_after_ms (-1 none, -2 never fits),
#          reservation id, then per target: used, reserved (including this request's
#          reservation when allowed)}; an allow is stored and a repeat returns it verbatim.
# Time is the Redis server clock (TIME), never the caller's.
ADMIT = (
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
local n = tonumber(ARGV[1])
local rid = ARGV[2]
local used, reserved, fits, retry = {}, {}, true, -1
for j = 1, n do
  local base = 4 + 6 * (j - 1)
  local limit = tonumber(ARGV[base])
  local window = tonumber(ARGV[base + 1])
  local bucket = tonumber(ARGV[base + 2])
  local boundary = ARGV[base + 3]
  local amount = tonumber(ARGV[base + 4])
  local starts, amounts, count = window_decode(redis.call('GET', KEYS[2 * j]), bucket)
  local u = window_total(starts, amounts, count, now, window, bucket, boundary)
  local r, first_expiry = 0, nil
  local pend = redis.call('HGETALL', KEYS[2 * j + 1])
  for i = 1, #pend, 2 do
    local a, exp = string.match(pend[i + 1], '^(%d+):(%d+)$')
    exp = tonumber(exp)
    if exp > now then
      r = r + tonumber(a)
      if first_expiry == nil or exp < first_expiry then first_expiry = exp end
    end
  end
  used[j], reserved[j] = u, r
  if u + r + amount > limit then
    fits = false
    local at, never = window_retry_after(starts, amounts, count, now, window, bucket,
                                         boundary, limit, r, amount)
    local wait
    if never then
      wait = -2
    elseif at then
      wait = at - now
    else
      -- Only in-flight reservations stand in the way: they settle by their expiry at latest.
      wait = (first_expiry or now + 1000) - now
    end
    if wait == -2 or retry == -2 then retry = -2 elseif wait > retry then retry = wait end
  end
end
local answer = {fits and 1 or 0, now, retry, rid}
for j = 1, n do
  -- An allow reports the state including its own reservation.
  local own = fits and tonumber(ARGV[4 + 6 * (j - 1) + 4]) or 0
  answer[#answer + 1] = used[j]
  answer[#answer + 1] = reserved[j] + own
end
if fits then
  for j = 1, n do
    local base = 4 + 6 * (j - 1)
    local amount = tonumber(ARGV[base + 4])
    local ttl = tonumber(ARGV[base + 5])
    redis.call('HSET', KEYS[2 * j + 1], rid, string.format('%d:%d', amount, now + ttl))
    if redis.call('PTTL', KEYS[2 * j + 1]) < ttl then
      redis.call('PEXPIRE', KEYS[2 * j + 1], ttl)
    end
  end
  redis.call('SET', KEYS[1], table.concat(answer, ','), 'PX', tonumber(ARGV[3]))
end
local out = {0}
for i = 1, #answer do out[#out + 1] = answer[i] end
return out
"""
)
