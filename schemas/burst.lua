-- spendgate token bucket: the Lua twin of spendgate/schemas/burst.py.
-- Library: local functions only; it reads no script keys or arguments and sets no globals.
-- Provides:
--   burst_parse(entry) -> rate, per_ms, capacity, or nil for "" (no burst)
--   burst_check(raw, rate, per_ms, capacity, now, amount) -> level, fits, wait_ms,
--     never_fits: as burst.check on the stored value raw (false: a full bucket)
--   burst_take(level, rate, per_ms, capacity, amount) -> new level, ttl_ms: the level after
--     taking amount (burst.take) and how long until it is full again (the stored state's
--     expiry: a missing state is a full bucket)
-- Every product stays below 2^53 (capacity * per_ms is bounded by the policy, and a refill
-- is only multiplied out while it is smaller than what the bucket lacks); divisions go
-- through math.fmod, so nothing is rounded.
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
