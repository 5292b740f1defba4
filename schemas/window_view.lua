-- spendgate window engine, in place: a version-2 window value read where it lies
-- (schemas/window_codec.py), for the O(1) reads of ADMIT and EXTEND.
-- Library: local functions only; it reads no script keys or arguments and sets no globals.
-- Needs spendgate.schemas:window included before it.
-- Provides:
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
