"""The Lua twin of the token-bucket engine (``schemas/burst.py``), run inside Redis.

``BURST_LUA_LIB`` is a chunk of ``local function`` definitions only (no ``KEYS``/``ARGV``,
no globals), prepended to the admit script after ``WINDOW_LUA_LIB``:

* ``burst_parse(entry) -> rate, per_ms, capacity`` or nil for ``""`` (no burst);
* ``burst_check(raw, rate, per_ms, capacity, now, amount) -> level, fits, wait_ms,
  never_fits``: as ``schemas.burst.check`` on the stored value ``raw`` (false/nil: full);
* ``burst_take(level, rate, per_ms, capacity, amount) -> new level, ttl_ms``: the level
  after taking ``amount`` (``schemas.burst.take``) and how long until it is full again
  (the stored state's expiry: a missing state is a full bucket).

Every product stays below 2**53 (``capacity * per_ms`` is bounded by the policy, and a
refill is only multiplied out while it is smaller than what the bucket lacks); divisions
go through ``math.fmod``, so nothing is rounded.
"""

from __future__ import annotations

__all__ = ["BURST_CHECK_SCRIPT", "BURST_LUA_LIB"]

BURST_LUA_LIB = r"""
-- spendgate token bucket, twin of schemas/burst.py.

-- Exact ceil(a / b) for integers 0 <= a < 2^53, b > 0.
local function burst_ceil_div(a, b)
  local m = math.fmod(a, b)
  local q = (a - m) / b
  if m > 0 then q = q + 1 end
  return q
end

local function burst_parse(entry)
  if entry == '' then return nil end
  local r, p, c = string.match(entry, '^(%d+):(%d+):(%d+)$')
  return tonumber(r), tonumber(p), tonumber(c)
end

local function burst_check(raw, rate, per, cap, now, amount)
  local full = cap * per
  local level = full
  if raw then
    local l, at = string.match(raw, '^(-?%d+):(-?%d+)$')
    level = tonumber(l)
    local need = full - level
    if need <= 0 then
      level = full
    else
      local elapsed = now - tonumber(at)
      if elapsed < 0 then elapsed = 0 end
      if elapsed >= burst_ceil_div(need, rate) then
        level = full
      else
        level = level + elapsed * rate
      end
    end
  end
  if amount > cap then return level, false, 0, true end
  local cost = amount * per
  if level >= cost then return level, true, 0, false end
  return level, false, burst_ceil_div(cost - level, rate), false
end

local function burst_take(level, rate, per, cap, amount)
  local taken = amount
  if taken > cap then taken = cap end
  local left = level - taken * per
  if left < 0 then left = 0 end
  return left, burst_ceil_div(cap * per - left, rate)
end
"""

BURST_CHECK_SCRIPT = (
    BURST_LUA_LIB
    + r"""
-- Test harness: one bucket check, and the take that would follow it.
-- KEYS[1]: a string key holding a bucket state (missing = full)
-- ARGV[1]: burst entry (rate:per_ms:capacity)   ARGV[2]: now ms   ARGV[3]: amount
-- returns: {level, fits (0/1), wait_ms, never_fits (0/1), level after the take,
--           ms until full after it}
local rate, per, cap = burst_parse(ARGV[1])
local amount = tonumber(ARGV[3])
local level, fits, wait, never = burst_check(redis.call('GET', KEYS[1]), rate, per, cap,
                                             tonumber(ARGV[2]), amount)
local left, ttl = burst_take(level, rate, per, cap, amount)
return {level, fits and 1 or 0, wait, never and 1 or 0, left, ttl}
"""
)
