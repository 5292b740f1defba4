-- spendgate window engine: the Lua twin of spendgate/schemas/windows.py and
-- spendgate/schemas/window_codec.py (a cross-check test runs both on thousands of random
-- cases).
-- Library: local functions only; it reads no script keys or arguments and sets no globals.
-- Provides:
--   window_decode(raw, bucket_ms) -> starts, amounts, n: a value written by
--     window_codec.encode, version 1 or 2 (raw false for a missing key: empty), as
--     parallel arrays sorted by bucket start in bucket_ms buckets; a value stored in
--     another width (the policy's bucket changed) is moved as windows.rebucket does;
--     raises on an unknown version. Work: O(buckets).
--   window_total(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary) -> total
--   window_retry_after(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary, limit,
--     extra, amount) -> fits_at_ms | nil, never_fits: as windows.retry_after
--   window_reset_after(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary, own) -> ms
--     until every amount counted at t_ms (and a reservation of own > 0 in the bucket of
--     t_ms) has aged out: the reset_after_seconds of the answers
--   window_combine(raw, pending, t_ms, window_ms, bucket_ms, boundary) -> starts, amounts,
--     n, absorbed, pending_part, stale: the absorbed window raw plus the pending window (an
--     HGETALL reply, or several concatenated, as window_codec.decode_pending reads them:
--     a version-2 hash's total field is skipped) bucket by bucket, as windows.combine;
--     stale lists the pending fields that can no longer count (to prune).
--     Work: O(buckets in the window), whatever the number of open reservations.
--   window_pending_field(t_ms, bucket_ms) -> the pending-window field of an amount admitted
--     at t_ms (window_codec.pending_field), as text
--   window_mod(x, m) -> x mod m in [0, m)
-- Lua numbers are doubles: every value passed in (times, limit, extra, amount) and their
-- sums must stay within 2^53; the codec guarantees it for the stored amounts. Divisions and
-- remainders go through math.fmod (exact in C) and the prorated share through an exact
-- split multiplication, so no result is ever rounded.
-- x mod m for integers, result in [0, m), exact for |x| < 2^53.
local function window_mod(x, m)
  local r = math.fmod(x, m)
  if r < 0 then r = r + m end
  return r
end

-- The last millisecond of the bucket holding t_ms: where an amount admitted then is pending.
local function window_pending_field(t_ms, bucket_ms)
  return string.format('%d', t_ms - window_mod(t_ms, bucket_ms) + bucket_ms - 1)
end

-- Exact ceil(x * k / b) for integers |x| < 2^53, 0 <= k < b < 2^32.
-- Works on |x| = q*b + rm so that q*k <= |x| * k / b stays below 2^53, and splits
-- rm*k as rm*(kh*2^20 + kl) so that no product reaches 2^53.
local function window_ceil_muldiv(x, k, b)
  local ax = math.abs(x)
  local rm = math.fmod(ax, b)
  local q = (ax - rm) / b
  local kl = math.fmod(k, 1048576)
  local kh = (k - kl) / 1048576
  local a = rm * kh
  local a0 = math.fmod(a, b)
  local a1 = (a - a0) / b
  local rest = a0 * 1048576 + rm * kl
  local r0 = math.fmod(rest, b)
  local floor_part = q * k + a1 * 1048576 + (rest - r0) / b  -- floor(|x| * k / b)
  if x < 0 then return -floor_part end
  if r0 > 0 then return floor_part + 1 end
  return floor_part
end

local function window_check_boundary(boundary)
  if boundary ~= 'include' and boundary ~= 'exclude' and boundary ~= 'prorate' then
    error('spendgate window: unknown boundary ' .. tostring(boundary))
  end
end

-- Decode the compact layout (see schemas/window_codec.py) into sorted arrays.
local function window_decode(raw, bucket_ms)
  local starts, amounts, n = {}, {}, 0
  if not raw then return starts, amounts, 0 end
  local version = string.byte(raw, 1)
  local kind, stored_ms, base, count, pos, neg_ms, total
  if version == 2 then
    version, kind, stored_ms, base, count, neg_ms, total, pos = struct.unpack(
      '<BBI4i8I4i8i8', raw)
  elseif version == 1 then
    version, kind, stored_ms, base, count, pos = struct.unpack('<BBI4i8I4', raw)
  else
    error('spendgate window state: unknown format version ' .. tostring(version))
  end
  -- Version 2 holds prefix sums: a bucket's amount is its prefix less the one before.
  local before = 0
  -- Unpacked up to 128 entries per call: one struct.unpack per entry costs twice as much.
  local done = 0
  if kind == 1 then
    while done < count do
      local m = math.min(count - done, 128)
      local values = {struct.unpack('<' .. string.rep('i8', m), raw, pos)}
      pos = values[m + 1]
      for j = 1, m do
        local amount = values[j]
        if version == 2 then amount, before = amount - before, amount end
        if amount ~= 0 then
          n = n + 1
          starts[n] = base + (done + j - 1) * stored_ms
          amounts[n] = amount
        end
      end
      done = done + m
    end
  elseif kind == 0 then
    while done < count do
      local m = math.min(count - done, 128)
      local values = {struct.unpack('<' .. string.rep('I4i8', m), raw, pos)}
      pos = values[2 * m + 1]
      for j = 1, m do
        local amount = values[2 * j]
        if version == 2 then amount, before = amount - before, amount end
        n = n + 1
        starts[n] = base + values[2 * j - 1] * stored_ms
        amounts[n] = amount
      end
      done = done + m
    end
  else
    error('spendgate window state: unknown kind ' .. tostring(kind))
  end
  if stored_ms ~= bucket_ms then
    -- The policy's bucket changed and the worker has not rewritten this key yet: move each
    -- old bucket to the new bucket holding its last millisecond (schemas.windows.rebucket,
    -- as the worker will), so nothing ages out earlier than before.
    local ns, na, nn = {}, {}, 0
    for i = 1, n do
      local last = starts[i] + stored_ms - 1
      local target = last - window_mod(last, bucket_ms)
      if nn > 0 and ns[nn] == target then
        na[nn] = na[nn] + amounts[i]
      else
        nn = nn + 1
        ns[nn], na[nn] = target, amounts[i]
      end
    end
    starts, amounts, n = {}, {}, 0
    for i = 1, nn do
      if na[i] ~= 0 then
        n = n + 1
        starts[n], amounts[n] = ns[i], na[i]
      end
    end
  end
  return starts, amounts, n
end

-- The boundary bucket's share when it overlaps the window on overlap_ms milliseconds.
local function window_boundary_part(boundary, edge, overlap_ms, bucket_ms)
  if overlap_ms <= 0 or edge == 0 or boundary == 'exclude' then return 0 end
  if boundary == 'include' then return edge end
  return window_ceil_muldiv(edge, overlap_ms, bucket_ms)
end

local function window_total(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary)
  window_check_boundary(boundary)
  local r = window_mod(t_ms, bucket_ms)
  local head = t_ms - r
  local oldest_full = head - window_ms + bucket_ms
  local edge_start = oldest_full - bucket_ms
  local full, edge = 0, 0
  for i = 1, n do
    local s = starts[i]
    if s >= oldest_full then  -- a bucket after head counts now too (windows.total)
      full = full + amounts[i]
    elseif s == edge_start then
      edge = amounts[i]
    end
  end
  return full + window_boundary_part(boundary, edge, bucket_ms - 1 - r, bucket_ms)
end

-- Smallest r in [r_lo, bucket_ms) at which the boundary share is <= slack, or nil.
local function window_earliest_offset(boundary, edge, slack, r_lo, bucket_ms)
  local last = bucket_ms - 1
  if edge == 0 or boundary == 'exclude' then
    if slack >= 0 then return r_lo end
    return nil
  end
  if boundary == 'include' then
    if r_lo < last and edge <= slack then return r_lo end
    if slack >= 0 then return last end
    return nil
  end
  local k_hi = last - r_lo
  if window_ceil_muldiv(edge, k_hi, bucket_ms) <= slack then return r_lo end
  if slack < 0 then return nil end  -- and a negative edge fitted above if at all
  -- The share grows with the overlap k: find the largest k whose share fits.
  local lo, hi = 0, k_hi
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if window_ceil_muldiv(edge, mid, bucket_ms) <= slack then lo = mid else hi = mid end
  end
  return last - lo
end

local function window_retry_after(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary,
                                  limit, extra, amount)
  window_check_boundary(boundary)
  if amount > limit then return nil, true end
  if window_total(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary) + extra + amount
      <= limit then
    return t_ms, false
  end
  local head = t_ms - window_mod(t_ms, bucket_ms)
  local periods, np = {head}, 1
  local by_start = {}
  for i = 1, n do
    local s = starts[i]
    by_start[s] = amounts[i]
    -- Every recorded bucket counts from now on (those after head too): only periods where
    -- one leaves or is the boundary can differ from the previous period's last
    -- millisecond: solve those and the current one.
    if s > head then np = np + 1; periods[np] = s end
    if s + window_ms > head then np = np + 1; periods[np] = s + window_ms end
  end
  table.sort(periods)
  local room = limit - extra - amount
  local lo, hi, full, previous = 1, n + 1, 0, nil
  for i = 1, n do full = full + amounts[i] end
  for j = 1, np do
    local period = periods[j]
    if period ~= previous then
      previous = period
      local oldest_full = period - window_ms + bucket_ms
      while lo < hi and starts[lo] < oldest_full do
        full = full - amounts[lo]
        lo = lo + 1
      end
      local r_lo = 0
      if period == head then r_lo = t_ms - head end
      local edge = by_start[period - window_ms] or 0
      local r = window_earliest_offset(boundary, edge, room - full, r_lo, bucket_ms)
      if r then return period + r, false end
    end
  end
  return nil, false
end

-- Milliseconds from t_ms until every amount counted at t_ms has aged out, assuming no new
-- usage and, when own > 0, a reservation of the caller's in the bucket of t_ms.
local function window_reset_after(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary, own)
  local head = t_ms - window_mod(t_ms, bucket_ms)
  local oldest = head - window_ms
  if boundary == 'exclude' then oldest = oldest + bucket_ms end
  local last = nil
  for i = 1, n do
    if amounts[i] ~= 0 and starts[i] >= oldest then
      if last == nil or starts[i] > last then last = starts[i] end
    end
  end
  if own > 0 and (last == nil or head > last) then last = head end
  if last == nil then return 0 end
  local gone = last + window_ms
  if boundary ~= 'exclude' then gone = gone + bucket_ms - 1 end
  if gone < t_ms then return 0 end
  return gone - t_ms
end

-- The absorbed window plus the pending window (HGETALL reply: a bucket's last ms ->
-- amount), as schemas.windows.combine after schemas.window_codec.decode_pending.
local function window_combine(raw, pending, t_ms, window_ms, bucket_ms, boundary)
  local starts, amounts, n = window_decode(raw, bucket_ms)
  local absorbed = window_total(starts, amounts, n, t_ms, window_ms, bucket_ms, boundary)
  local stale = {}
  if #pending == 0 then return starts, amounts, n, absorbed, 0, stale end
  local live = t_ms + 1 - window_mod(t_ms + 1, bucket_ms) - window_ms
  local by_start, order = {}, {}
  for i = 1, #pending, 2 do
    local last = tonumber(pending[i])
    local start = last and last - window_mod(last, bucket_ms)
    if not last then
      -- A version-2 pending window's total field: it sums the others.
    elseif start < live then
      stale[#stale + 1] = pending[i]
    elseif by_start[start] then
      by_start[start] = by_start[start] + tonumber(pending[i + 1])
    else
      order[#order + 1] = start
      by_start[start] = tonumber(pending[i + 1])
    end
  end
  if #order == 0 then return starts, amounts, n, absorbed, 0, stale end
  table.sort(order)
  local ms, ma, mn, i, j, np = {}, {}, 0, 1, 1, #order
  while i <= n or j <= np do
    local s, v
    if j > np or (i <= n and starts[i] < order[j]) then
      s, v = starts[i], amounts[i]
      i = i + 1
    elseif i > n or order[j] < starts[i] then
      s, v = order[j], by_start[order[j]]
      j = j + 1
    else
      s, v = starts[i], amounts[i] + by_start[order[j]]
      i, j = i + 1, j + 1
    end
    if v ~= 0 then
      mn = mn + 1
      ms[mn], ma[mn] = s, v
    end
  end
  local combined = window_total(ms, ma, mn, t_ms, window_ms, bucket_ms, boundary)
  return ms, ma, mn, absorbed, combined - absorbed, stale
end
