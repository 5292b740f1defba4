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
--   window_view(first, bucket_ms, read) -> v | nil: a reader of a version-2 value stored
--     in bucket_ms buckets, from its first bytes (WINDOW_FIRST_BYTES of them, or all;
--     false or '': the empty window) and read(from, to), which returns the bytes from..to
--     (GETRANGE) for the rest; nil for anything else (decode it).
--   window_fetch(v, lo, hi): read a few dense slots lo..hi at once (ahead of prefix reads);
--     window_index(v, s) -> the slot of the bucket at s
--   window_prefix(v, s) -> the sum of the amounts of v's buckets starting at or before s
--     (bucket-aligned); window_amount(v, s) -> the amount of the bucket at s;
--     window_newest(v) -> the start of v's newest bucket, or nil when v is empty;
--     window_negative_from(v, s) -> whether a bucket at or after s has a negative amount.
--     Work: O(1) dense, O(log n) sparse.
--   window_share(boundary, edge, t_ms, bucket_ms) -> what the boundary bucket's amount
--     edge counts at t_ms
--   window_search_retry(full_of, edge_of, t_ms, window_ms, bucket_ms, boundary, room)
--     -> fits_at_ms | nil: window_retry_after's answer (limit - extra - amount = room >= 0)
--     when the total can only fall from t_ms on (no negative amount from the boundary
--     bucket on, nothing after the bucket of t_ms: the caller checks), by binary search
--     over the bucket periods; full_of(P) is the sum of the buckets in
--     [P - window_ms + bucket_ms, P], edge_of(P) the amount of the bucket P - window_ms.
--     Work: O(log(window / bucket)) calls of each.
--   window_dense_retry(v, t_ms, window_ms, bucket_ms, boundary, room, pending_from,
--     pending_at) -> the same for a dense view v under the same conditions, reading only
--     its summary and one group of WINDOW_GROUP slots (pending_from(s), pending_at(s): the
--     pending amounts of the buckets starting at or after s, and at s)
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
    if s >= oldest_full and s <= head then
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
    -- Only periods where a bucket enters (as the head) or is the boundary can differ
    -- from the previous period's last millisecond: solve those and the current one.
    if s > head then np = np + 1; periods[np] = s end
    if s + window_ms > head then np = np + 1; periods[np] = s + window_ms end
  end
  table.sort(periods)
  local room = limit - extra - amount
  local lo, hi, full, previous = 1, 1, 0, nil
  for j = 1, np do
    local period = periods[j]
    if period ~= previous then
      previous = period
      while hi <= n and starts[hi] <= period do
        full = full + amounts[hi]
        hi = hi + 1
      end
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

-- A version-2 value read in place: its header, and its body at computed offsets. A dense
-- value longer than its first bytes is read in ranges (GETRANGE: copying a 12 KB value
-- into Lua costs more than the whole decision), its slots kept once read.
local WINDOW_HEAD = 34  -- header bytes (version 2): the body starts after them
local WINDOW_FIRST_BYTES = 74  -- the header, the first 4 dense slots and a summary entry
local WINDOW_GROUP = 32  -- dense slots per summary entry (window_codec.SUMMARY_GROUP)

local function window_view(first, bucket_ms, read)
  if not first or first == '' then
    return {n = 0, kind = 1, base = 0, b = bucket_ms, neg = -1, slots = {}}
  end
  if string.byte(first, 1) ~= 2 or #first < WINDOW_HEAD then return nil end
  local _, kind, stored_ms, base, count, neg, total, s0, s1, s2, s3 = struct.unpack(
    '<BBI4i8I4i8i8' .. string.rep('i8', math.min(4, math.floor((#first - WINDOW_HEAD) / 8))),
    first)
  if stored_ms ~= bucket_ms then return nil end
  if kind ~= 0 and kind ~= 1 then
    error('spendgate window state: unknown kind ' .. tostring(kind))
  end
  local v = {kind = kind, b = stored_ms, base = base, n = count, neg = neg}
  local size = WINDOW_HEAD + count * 12
  if kind == 1 then size = WINDOW_HEAD + 8 * (count + math.ceil(count / WINDOW_GROUP)) end
  if #first >= size then
    v.raw = first
  elseif kind == 0 then
    v.raw = read(0, -1)  -- sparse: searched in place, so read whole
  else
    -- The first 4 slots, and the last: the window's sum, in the header.
    v.read = read
    v.slots = {[0] = s0, s1, s2, s3}
    v.slots[count - 1] = total
  end
  return v
end

-- Read dense slots lo..hi (clipped to the value; a few at most) into the slot cache, unless
-- every one is known already.
local function window_fetch(v, lo, hi)
  if v.raw or v.n == 0 then return end
  if lo < 0 then lo = 0 end
  if hi > v.n - 1 then hi = v.n - 1 end
  local missing = false
  for i = lo, hi do
    if v.slots[i] == nil then
      missing = true
      break
    end
  end
  if not missing then return end
  local values = {struct.unpack('<' .. string.rep('i8', hi - lo + 1),
                                v.read(WINDOW_HEAD + 8 * lo, WINDOW_HEAD + 8 * hi + 7))}
  for j = 0, hi - lo do v.slots[lo + j] = values[j + 1] end
end

local function window_index(v, s)
  return math.floor((s - v.base) / v.b)
end

-- A dense slot's prefix, from wherever it is known (read when not).
local function window_slot(v, i)
  if v.raw then return (struct.unpack('<i8', v.raw, WINDOW_HEAD + 1 + 8 * i)) end
  local value = v.slots[i]
  if value == nil then
    window_fetch(v, i, i)
    value = v.slots[i]
  end
  return value
end

-- The body starts at position WINDOW_HEAD + 1; a sparse entry is 12 bytes (offset
-- u32, then the prefix i64), a dense slot 8 (the prefix).
local function window_offset_at(v, j)
  return (struct.unpack('<I4', v.raw, WINDOW_HEAD + 1 + 12 * j))
end

local function window_prefix(v, s)
  if v.n == 0 or s < v.base then return 0 end
  local idx = window_index(v, s)
  if v.kind == 1 then
    if idx >= v.n then idx = v.n - 1 end
    return window_slot(v, idx)
  end
  -- The last entry whose offset is at most idx (the first one's is 0).
  local lo, hi = 0, v.n - 1
  if window_offset_at(v, hi) <= idx then
    lo = hi
  else
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if window_offset_at(v, mid) <= idx then lo = mid else hi = mid - 1 end
    end
  end
  return (struct.unpack('<i8', v.raw, WINDOW_HEAD + 5 + 12 * lo))
end

local function window_amount(v, s)
  return window_prefix(v, s) - window_prefix(v, s - v.b)
end

local function window_newest(v)
  if v.n == 0 then return nil end
  if v.kind == 1 then return v.base + (v.n - 1) * v.b end
  return v.base + window_offset_at(v, v.n - 1) * v.b
end

local function window_negative_from(v, s)
  return v.neg >= 0 and v.neg >= s
end

local function window_share(boundary, edge, t_ms, bucket_ms)
  return window_boundary_part(boundary, edge, bucket_ms - 1 - window_mod(t_ms, bucket_ms),
                              bucket_ms)
end

-- With the total only falling, a period fits somewhere iff it fits at its last
-- millisecond, where the boundary bucket counts nothing: iff full_of(period) <= room, a
-- predicate that holds from some period on. Find that period, then the offset in it.
local function window_search_retry(full_of, edge_of, t_ms, window_ms, bucket_ms, boundary,
                                   room)
  window_check_boundary(boundary)
  local head = t_ms - window_mod(t_ms, bucket_ms)
  local k = 0
  if full_of(head) > room then
    local lo, hi = 0, window_ms / bucket_ms  -- full_of(head + window_ms) sums nothing
    if full_of(head + hi * bucket_ms) > room then return nil end
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if full_of(head + mid * bucket_ms) <= room then hi = mid else lo = mid end
    end
    k = hi
  end
  local period = head + k * bucket_ms
  local r_lo = 0
  if k == 0 then r_lo = t_ms - head end
  local r = window_earliest_offset(boundary, edge_of(period), room - full_of(period), r_lo,
                                   bucket_ms)
  if not r then return nil end
  return period + r
end

-- window_search_retry for a dense value, reading its summary and one group of slots: the
-- periods whose boundary bucket ends a group first (their prefixes are the summary's),
-- then inside the group found. pending_from(s) and pending_at(s) give the pending buckets
-- starting at or after s, and at s.
local function window_dense_retry(v, t_ms, window_ms, bucket_ms, boundary, room, pending_from,
                                  pending_at)
  window_check_boundary(boundary)
  local b, w, n = bucket_ms, window_ms, v.n
  local head = t_ms - window_mod(t_ms, b)
  local kmax = w / b
  local i0 = window_index(v, head - w)  -- the slot of period head's boundary bucket
  local total = 0
  if n > 0 then total = window_slot(v, n - 1) end
  local groups = math.ceil(n / WINDOW_GROUP)
  -- Bytes read at once, each value unpacked only when the search asks for it.
  local summary, summary_pos, block, block_lo, block_hi = nil, 1, nil, 0, -1
  local function prefix(i)
    if i < 0 then return 0 end
    if i >= n - 1 then return total end
    if i >= block_lo and i <= block_hi then
      return (struct.unpack('<i8', block, 1 + 8 * (i - block_lo)))
    end
    if summary and window_mod(i, WINDOW_GROUP) == WINDOW_GROUP - 1 then
      return (struct.unpack('<i8', summary, summary_pos + 8 * math.floor(i / WINDOW_GROUP)))
    end
    return window_slot(v, i)
  end
  -- With nothing after head, period head + k * b sums total - prefix(i0 + k), plus what is
  -- pending from its oldest full bucket on.
  local function fits(k)
    return total - prefix(i0 + k) + pending_from(head - w + (k + 1) * b) <= room
  end
  local k = 0
  if not fits(0) then
    local lo, hi = 0, kmax
    if not fits(hi) then return nil end
    if hi - lo > WINDOW_GROUP then
      if v.raw then
        summary, summary_pos = v.raw, WINDOW_HEAD + 1 + 8 * n
      else
        summary = v.read(WINDOW_HEAD + 8 * n, WINDOW_HEAD + 8 * (n + groups) - 1)
      end
      -- The k whose slot ends a group, inside (lo, hi): first + j * WINDOW_GROUP.
      local first = window_mod(WINDOW_GROUP - 1 - i0, WINDOW_GROUP)
      if first == 0 then first = WINDOW_GROUP end
      local jl, jh = -1, math.floor((hi - 1 - first) / WINDOW_GROUP) + 1
      -- fits(first + jl * G) is false (or jl = -1: lo), fits(first + jh * G) true (or hi).
      while jh - jl > 1 do
        local mid = math.floor((jl + jh) / 2)
        if fits(first + mid * WINDOW_GROUP) then jh = mid else jl = mid end
      end
      if jl >= 0 then lo = first + jl * WINDOW_GROUP end
      if first + jh * WINDOW_GROUP < hi then hi = first + jh * WINDOW_GROUP end
    end
    -- Inside: the slots of (lo, hi] and the one before, read at once.
    local s_lo, s_hi = math.max(i0 + lo, 0), math.min(i0 + hi, n - 2)
    if s_hi >= s_lo and not v.raw then
      block, block_lo, block_hi = v.read(WINDOW_HEAD + 8 * s_lo, WINDOW_HEAD + 8 * s_hi + 7),
        s_lo, s_hi
    end
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if fits(mid) then hi = mid else lo = mid end
    end
    k = hi
  end
  local period = head + k * b
  local edge = prefix(i0 + k) - prefix(i0 + k - 1) + pending_at(period - w)
  local full = total - prefix(i0 + k) + pending_from(period - w + b)
  local r_lo = 0
  if k == 0 then r_lo = t_ms - head end
  local r = window_earliest_offset(boundary, edge, room - full, r_lo, b)
  if not r then return nil end
  return period + r
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
