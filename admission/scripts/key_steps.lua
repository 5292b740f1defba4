-- spendgate budget-key steps that ADMIT and EXTEND share.
-- Library: local functions only; it reads no script keys or arguments and sets no globals.
-- Needs spendgate.schemas:window, spendgate.schemas:window_view and
-- spendgate.schemas:redis_values included before it.
-- Provides:
--   marks_states(marks_key, names, now, staleness_ms) -> states, marks: per mark field, 0
--     vouched, 1 stale (older than now - staleness_ms), 2 missing (codes.STATES), and its
--     watermark (ms, nil when missing)
--   key_state(deps, states, marks) -> the worst state of the marks a key depends on (deps:
--     the comma-separated 1-based indexes into states), and (given marks) their least
--     watermark (nil when one is missing)
--   key_load(x, now): read the key x at now (x.wkey the absorbed window, x.pwkey the
--     version-1 pending window, x.pvkey and x.pqkey the version-2 one and its queue,
--     x.window, x.bucket, x.boundary): x.used (absorbed; a refund larger than what it
--     corrects never makes room) and x.reserved (what the pending windows add to it).
--     With x.repair, expired entries the worker has absorbed since are cleared first
--     (needs x.state and x.mark: see "Expiry" below).
--     Work: O(1) reads when the absorbed window is a version-2 value in the policy's
--     width and no version-1 pending window exists; otherwise the whole window is
--     decoded (O(buckets)), as before version 2.
--   key_reset_after(x, now, own) -> ms until every amount counted at now has aged out
--     (and a reservation of own > 0 in the bucket of now)
--   key_retry_after(x, now) -> fits_at_ms | nil, never_fits: when x's amount fits again
--     with nothing new admitted. O(log(window / bucket)) when the total can only fall
--     (no negative amount from the boundary bucket on, nothing future-dated, no
--     version-1 pending window), else the exact walk over every bucket.
--   key_hold(x, entry, amount, now): age out the pending buckets that left the window and,
--     when amount > 0, hold it in the pending window in the bucket of now under the
--     pending entry named entry: the version-2 window when the absorbed window is a
--     version-2 value (its worker absorbs version 2), else version 1; every key it writes
--     lives window + bucket past the last write. Every hold is also queued for expiry
--     (x.pekey, due x.ttl ms after now); every EXPIRY_EVERY holds queued, up to EXPIRY_STEP
--     due or absorbed holds leave the head of that queue (see "Expiry" below).
--
-- The version-2 pending window: x.pvkey holds each bucket's amount under the bucket's last
-- millisecond, their sum under 't' (window_codec.PENDING_TOTAL_FIELD), each reservation's
-- pending entry under 'r:' + its id (redis_values.PENDING_ENTRY_PREFIX) and the queue's first
-- and last field under 'h' and 'n'; x.pqkey lists
-- the bucket fields oldest first, each once. A field whose amount was absorbed away is
-- deleted from the hash and skipped in the list. Only the list's ends are read: buckets
-- that left the window leave from its head (their amounts from the sum), the newest
-- bucket is at its tail.
--
-- Expiry (the worker is down or behind: nobody absorbs): every hold is queued in x.pekey as
-- "<due ms>:<pending window version>:<entry name>", in hold order. A hold still pending at
-- its due time (its reservation_ttl) is expired by admission itself: its entry goes, its
-- amount stays in its bucket (the design's abandoned reservation: charged in full) and is
-- noted under 'x:' + field in the same pending window (version 1 or 2), with 'xt' the Redis
-- clock of the latest expiry. The worker absorbs such a
-- reservation when it comes back (it charges it in its windows; with no entry, ABSORB moves
-- nothing), so once the key's marks vouch for every record appended up to 'xt' (plus
-- EXPIRED_MARGIN_MS for the broker's clock), every expired amount is in the absorbed window
-- and the 'x:' amounts leave the pending window: counted once again. A reservation whose
-- reserve is still unpublished (x.unpub: the admit script's own shard) is not expired; it is
-- queued again. So the entries a key holds never exceed the holds of one reservation_ttl,
-- whatever the worker does, and its expiry queue only holds the holds not yet absorbed.

local PENDING_TOTAL = 't'
local PENDING_HEAD, PENDING_NEWEST = 'h', 'n'  -- the queue's first and last field, in the hash
local PENDING_ENTRY = 'r:'  -- a reservation's entry in the version-2 hash: 'r:' .. id
local PENDING_EXPIRED = 'x:'  -- the part of a bucket's amount whose entries expired
local PENDING_EXPIRED_AT = 'xt'  -- the Redis clock of the latest expiry
-- Every EXPIRY_EVERY holds queued, up to EXPIRY_STEP queued holds are looked at (more than
-- were queued in between, so the queue's head keeps up).
local EXPIRY_EVERY, EXPIRY_STEP = 4, 8
local EXPIRED_MARGIN_MS = 1000  -- how far the broker's clock may run ahead of Redis's

local function marks_states(marks_key, names, now, staleness_ms)
  local states, marks = {}, {}
  if #names == 0 then return states, marks end
  local seen = redis.call('HMGET', marks_key, unpack(names))
  local oldest = now - staleness_ms
  for i = 1, #names do
    marks[i] = tonumber(seen[i])
    if not seen[i] then
      states[i] = 2
    elseif marks[i] < oldest then
      states[i] = 1
    else
      states[i] = 0
    end
  end
  return states, marks
end

local function key_state(deps, states, marks)
  local state, least = 0, nil
  for d in string.gmatch(deps, '%d+') do
    local i = tonumber(d)
    local st = states[i]
    if st > state then state = st end
    if marks then
      local m = marks[i]
      if not m then
        marks = nil
        least = nil
      elseif not least or m < least then
        least = m
      end
    end
  end
  return state, least
end

-- The version-2 pending window at now: its sum, what left the window (stale fields at the
-- list's head), the boundary bucket, the newest bucket (it may be after the bucket of now:
-- a field of a wider bucket width, or the clock went back; it counts now all the same, as
-- windows.total counts every bucket after now). q.ok is false when the list's last entries
-- do not settle the newest bucket or the list lost entries (then the key is read whole);
-- q.repair when the hash holds amounts the list does not name.
local function pending_read(x, now, v2)
  local b = x.bucket
  local q = {total = 0, full = 0, edge = 0, stale = {}, stale_sum = 0, ok = true, tail = {}}
  if not v2 then return q end
  local head = now - window_mod(now, b)
  local live = now + 1 - window_mod(now + 1, b) - x.window
  local oldest_full = head - x.window + b
  -- Usually one HMGET: the sum, the queue's ends and the bucket of now. Nothing has left
  -- the window or reached its boundary since the oldest bucket queued, nothing is after
  -- head, and the newest bucket queued is still pending: then that is all there is to read.
  local cur = window_pending_field(now, b)
  local got = redis.call('HMGET', x.pvkey, PENDING_TOTAL, PENDING_HEAD, PENDING_NEWEST, cur,
                        PENDING_EXPIRED_AT)
  local sum, first, last = tonumber(got[1]), tonumber(got[2]), tonumber(got[3])
  q.xt = tonumber(got[5])
  if sum and first and last and first - window_mod(first, b) >= oldest_full
      and last - window_mod(last, b) <= head then
    local amount = tonumber(got[4])
    if got[3] ~= cur then amount = tonumber(redis.call('HGET', x.pvkey, got[3])) end
    if amount then
      q.total, q.full = sum, sum
      q.newest, q.newest_amount = last - window_mod(last, b), amount
      q.tail, q.tail_amounts, q.fast = {got[3]}, {amount}, true
      return q
    end
  end
  local chunk = redis.call('LRANGE', x.pqkey, 0, 7)
  if #chunk == 0 then
    local total = tonumber(redis.call('HGET', x.pvkey, PENDING_TOTAL) or '0')
    -- The sum names amounts the list lost (its key expired apart from the hash).
    if total ~= 0 then q.total, q.ok, q.repair = total, false, true end
    return q
  end
  local edge_fields, from, whole = {}, 0, #chunk < 8
  while true do
    local j, stop = 1, false
    while j <= #chunk do
      local f = tonumber(chunk[j])
      if f - window_mod(f, b) < live then
        -- Each field once (an entry out of order may repeat one), every entry popped.
        q.pop = (q.pop or 0) + 1
        if q.stale[#q.stale] ~= chunk[j] then q.stale[#q.stale + 1] = chunk[j] end
      elseif f < oldest_full then
        edge_fields[#edge_fields + 1] = chunk[j]
      else
        stop = true
        break
      end
      j = j + 1
    end
    if stop or #chunk < 8 then break end
    from = from + 8
    chunk = redis.call('LRANGE', x.pqkey, from, from + 7)
    whole = false
  end
  local tail = chunk
  if not whole then
    tail = redis.call('LRANGE', x.pqkey, -4, -1)
  elseif #tail > 4 then
    tail = {unpack(chunk, #chunk - 3, #chunk)}
  end
  q.tail = tail
  local ask = {PENDING_TOTAL}
  for i = 1, #q.stale do ask[#ask + 1] = q.stale[i] end
  for i = 1, #edge_fields do ask[#ask + 1] = edge_fields[i] end
  for i = #tail, 1, -1 do ask[#ask + 1] = tail[i] end
  local got = redis.call('HMGET', x.pvkey, unpack(ask))
  q.total = tonumber(got[1]) or 0
  local i = 1
  for _ = 1, #q.stale do
    i = i + 1
    q.stale_sum = q.stale_sum + (tonumber(got[i]) or 0)
  end
  for _ = 1, #edge_fields do
    i = i + 1
    q.edge = q.edge + (tonumber(got[i]) or 0)
  end
  -- From the newest entry back: the first present one is the newest bucket (buckets after
  -- head count now too: q.full keeps them).
  local past_head = false
  q.tail_amounts = {}
  for k = 1, #tail do
    local amount = tonumber(got[i + k])
    q.tail_amounts[#tail + 1 - k] = amount
    local f = tonumber(tail[#tail + 1 - k])
    local start = f - window_mod(f, b)
    if start <= head then past_head = true end
    if amount and not q.newest and start >= live then
      q.newest, q.newest_amount = start, amount
    end
  end
  q.full = q.total - q.stale_sum - q.edge
  -- Amounts still pending but the last entries settle neither what lies after head nor
  -- the newest bucket: read the key whole.
  if not past_head and not whole then q.ok = false end
  if not q.newest and q.full + q.edge ~= 0 then q.ok = false end
  return q
end

-- Every pending bucket of both versions, absorbed and pending merged bucket by bucket.
local function key_arrays(x, now)
  if x.starts then return end
  if x.raw == nil then x.raw = redis.call('GET', x.wkey) end
  local pending = redis.call('HGETALL', x.pwkey)
  local p1 = #pending
  local v2 = redis.call('HGETALL', x.pvkey)
  for i = 1, #v2 do pending[p1 + i] = v2[i] end
  local absorbed, part
  x.starts, x.amounts, x.count, absorbed, part, x.stale = window_combine(
    x.raw, pending, now, x.window, x.bucket, x.boundary)
  return absorbed, part
end

-- The 'x:' amounts leave their buckets and the sum (see "Expiry"): the worker's windows hold
-- them now. A field the list no longer names left the window with its bucket.
local function pending_clear_expired(x)
  local fields = redis.call('LRANGE', x.pqkey, 0, -1)
  local total = tonumber(redis.call('HGET', x.pvkey, PENDING_TOTAL) or '0')
  local seen = {}
  for i = 1, #fields, 500 do
    local part, ask = {}, {}
    for j = i, math.min(i + 499, #fields) do
      local f = fields[j]
      if not seen[f] then
        seen[f] = true
        part[#part + 1] = f
        ask[#ask + 1] = PENDING_EXPIRED .. f
        ask[#ask + 1] = f
      end
    end
    if #part > 0 then
      local got = redis.call('HMGET', x.pvkey, unpack(ask))
      local names = {}
      for j = 1, #part do
        local gone, held = tonumber(got[2 * j - 1]), tonumber(got[2 * j]) or 0
        if gone then
          names[#names + 1] = ask[2 * j - 1]
          if held > gone then
            redis.call('HINCRBY', x.pvkey, part[j], string.format('%d', -gone))
          else
            redis.call('HDEL', x.pvkey, part[j])
          end
          total = total - math.min(held, gone)
        end
      end
      if #names > 0 then redis.call('HDEL', x.pvkey, unpack(names)) end
    end
  end
  redis.call('HDEL', x.pvkey, PENDING_EXPIRED_AT)
  if total <= 0 then
    redis.call('DEL', x.pvkey, x.pqkey)
  else
    redis.call('HSET', x.pvkey, PENDING_TOTAL, string.format('%d', total))
  end
end

-- The same for the version-1 pending window (bounded by its buckets: read whole).
local function pending_clear_expired_v1(x)
  local all = redis.call('HGETALL', x.pwkey)
  local amounts, gone = {}, {}
  for i = 1, #all, 2 do
    local f = all[i]
    if string.sub(f, 1, 2) == PENDING_EXPIRED then
      gone[string.sub(f, 3)] = tonumber(all[i + 1])
    else
      amounts[f] = tonumber(all[i + 1])
    end
  end
  local names = {PENDING_EXPIRED_AT}
  for f, a in pairs(gone) do
    names[#names + 1] = PENDING_EXPIRED .. f
    local held = amounts[f] or 0
    if held > a then
      redis.call('HINCRBY', x.pwkey, f, string.format('%d', -a))
    else
      names[#names + 1] = f
    end
  end
  redis.call('HDEL', x.pwkey, unpack(names))
end

local function key_load(x, now)
  local first = redis.call('GETRANGE', x.wkey, 0, WINDOW_FIRST_BYTES - 1)
  x.hold_v2 = string.byte(first, 1) == 2
  -- Which pending windows exist: one call, and none more when neither does.
  local held = redis.call('EXISTS', x.pwkey, x.pvkey)
  x.q = pending_read(x, now, held > 0)
  if x.q.xt and x.repair and x.state == 0 and x.mark
      and x.mark > x.q.xt + EXPIRED_MARGIN_MS then
    pending_clear_expired(x)
    x.q = pending_read(x, now, true)
  end
  -- The version-1 window exists when both do, or when the one that does holds no sum.
  local v1 = held == 2
  if held == 1 and x.q.total == 0 and not x.q.repair then
    v1 = redis.call('EXISTS', x.pwkey) == 1
  end
  if v1 and x.repair and x.state == 0 and x.mark then
    local xt = tonumber(redis.call('HGET', x.pwkey, PENDING_EXPIRED_AT))
    if xt and x.mark > xt + EXPIRED_MARGIN_MS then pending_clear_expired_v1(x) end
  end
  local wkey = x.wkey
  x.view = window_view(first, x.bucket, function(a, z)
    return redis.call('GETRANGE', wkey, a, z)
  end)
  if first == '' then x.raw = false elseif x.view and x.view.raw then x.raw = x.view.raw end
  if x.view and x.q.ok and not v1 then
    local b = x.bucket
    local v = x.view
    local edge_start = now - window_mod(now, b) - x.window
    if not v.raw then  -- usually known already: the first slots and the last
      local e = window_index(v, edge_start)
      window_fetch(v, e - 1, e)
    end
    local at_edge = window_prefix(v, edge_start)
    -- Every bucket from the boundary on, those after head too (windows.total): the window's
    -- last prefix (its sum, known from the header).
    local top = window_newest(v) or edge_start
    if top < edge_start + x.window then top = edge_start + x.window end
    local full = window_prefix(v, top) - at_edge
    local edge = at_edge - window_prefix(v, edge_start - b)
    local absorbed = full + window_share(x.boundary, edge, now, b)
    x.used = absorbed
    x.reserved = full + x.q.full + window_share(x.boundary, edge + x.q.edge, now, b) - absorbed
    x.stale = {}
  else
    x.view = nil
    local absorbed, part = key_arrays(x, now)
    x.used, x.reserved = absorbed, part
  end
  if x.used < 0 then x.used = 0 end
end

local function key_reset_after(x, now, own)
  if x.view then
    local head = now - window_mod(now, x.bucket)
    local oldest = head - x.window
    if x.boundary == 'exclude' then oldest = oldest + x.bucket end
    local last = window_newest(x.view)
    local pend = x.q.newest
    local exact = true
    if pend and pend == last then
      -- The same bucket absorbed and pending: a refund may cancel what is pending there.
      exact = window_amount(x.view, last) + x.q.newest_amount ~= 0
    elseif pend and (last == nil or pend > last) then
      last = pend
    end
    if exact then
      if last and last < oldest then last = nil end
      if own > 0 and (last == nil or head > last) then last = head end
      if last == nil then return 0 end
      local gone = last + x.window
      if x.boundary ~= 'exclude' then gone = gone + x.bucket - 1 end
      if gone < now then return 0 end
      return gone - now
    end
  end
  key_arrays(x, now)
  return window_reset_after(x.starts, x.amounts, x.count, now, x.window, x.bucket, x.boundary,
                            own)
end

local function key_retry_after(x, now)
  if x.amount > x.limit then return nil, true end
  local b, w = x.bucket, x.window
  local head = now - window_mod(now, b)
  local v = x.view
  if v and not window_negative_from(v, head - w)
      and (window_newest(v) or head) <= head
      and (x.q.newest or head) <= head then
    -- Every pending bucket, oldest first, with the sums from each one on.
    local ps, pa, from = {}, {}, {}
    if x.q.total ~= 0 then
      local fields = redis.call('LRANGE', x.pqkey, 0, -1)
      local got = redis.call('HMGET', x.pvkey, unpack(fields))
      local live = head - w
      for i = 1, #fields do
        local amount = tonumber(got[i])
        local f = tonumber(fields[i])
        local start = f - window_mod(f, b)
        if amount and start >= live then
          if #ps > 0 and ps[#ps] == start then
            pa[#pa] = pa[#pa] + amount
          else
            ps[#ps + 1], pa[#pa + 1] = start, amount
          end
        end
      end
    end
    local sum = 0
    for i = #ps, 1, -1 do
      sum = sum + pa[i]
      from[i] = sum
    end
    local function pending_from(s)  -- the pending buckets starting at or after s
      for i = 1, #ps do
        if ps[i] >= s then return from[i] end
      end
      return 0
    end
    local function pending_at(s)
      for i = 1, #ps do
        if ps[i] == s then return pa[i] end
      end
      return 0
    end
    local room = x.limit - x.amount
    if v.kind == 1 then
      return window_dense_retry(v, now, w, b, x.boundary, room, pending_from, pending_at), false
    end
    local function full_of(period)
      return window_prefix(v, period) - window_prefix(v, period - w)
        + pending_from(period - w + b)
    end
    local function edge_of(period)
      return window_amount(v, period - w) + pending_at(period - w)
    end
    return window_search_retry(full_of, edge_of, now, w, b, x.boundary, room), false
  end
  key_arrays(x, now)
  return window_retry_after(x.starts, x.amounts, x.count, now, w, b, x.boundary, x.limit, 0,
                            x.amount)
end

-- The list again from the hash, oldest bucket first (it lost entries).
local function pending_requeue(x)
  local fields = {}
  local all = redis.call('HGETALL', x.pvkey)
  for i = 1, #all, 2 do
    local f = tonumber(all[i])  -- bucket fields only, not the sum nor the entries
    if f then fields[#fields + 1] = f end
  end
  table.sort(fields)
  redis.call('DEL', x.pqkey)
  for i = 1, #fields, 1000 do
    local part = {}
    for j = i, math.min(i + 999, #fields) do part[#part + 1] = string.format('%d', fields[j]) end
    redis.call('RPUSH', x.pqkey, unpack(part))
  end
  if #fields > 0 then
    redis.call('HSET', x.pvkey, PENDING_HEAD, string.format('%d', fields[1]), PENDING_NEWEST,
               string.format('%d', fields[#fields]))
  end
  local ttl = redis.call('PTTL', x.pvkey)
  if ttl > 0 then redis.call('PEXPIRE', x.pqkey, ttl) end
  x.q.tail, x.q.tail_amounts = {}, nil
  if #fields > 0 then x.q.tail = {string.format('%d', fields[#fields])} end
end

-- The hash a hold of pending-window version v ('1' or '2') sits in, the hash of its entry,
-- and its entry's name there.
local function held_in(x, v, name)
  if v == '2' then return x.pvkey, x.pvkey, PENDING_ENTRY .. name end
  return x.pwkey, x.prkey, name
end

-- Up to EXPIRY_STEP holds leave the head of the expiry queue: absorbed ones, and due ones
-- still pending, which expire (see "Expiry").
local function pending_expire(x, now)
  -- Usually the head decides alone: neither due nor absorbed (nothing leaves), read in two
  -- calls.
  local head = redis.call('LINDEX', x.pekey, 0)
  if not head then return end
  local due, v, name = string.match(head, '^(%d+):(%d):(.*)$')
  if tonumber(due) > now then
    local _, hash, entry = held_in(x, v, name)
    if redis.call('HEXISTS', hash, entry) == 1 then return end
  end
  local heads = redis.call('LRANGE', x.pekey, 0, EXPIRY_STEP - 1)
  local dues, versions, names, entries = {}, {}, {}, {}
  local asks = {}  -- entries hash -> {names, head indexes}
  for i = 1, #heads do
    local due, v, name = string.match(heads[i], '^(%d+):(%d):(.*)$')
    dues[i], versions[i], names[i] = tonumber(due), v, name
    local _, hash, entry = held_in(x, v, name)
    local ask = asks[hash]
    if not ask then
      ask = {{}, {}}
      asks[hash] = ask
    end
    ask[1][#ask[1] + 1], ask[2][#ask[2] + 1] = entry, i
  end
  for hash, ask in pairs(asks) do
    local got = redis.call('HMGET', hash, unpack(ask[1]))
    for j = 1, #ask[2] do entries[ask[2][j]] = got[j] end
  end
  local popped, again, marked = 0, {}, {}
  for i = 1, #heads do
    local entry = entries[i]
    if entry and dues[i] > now then break end
    popped = i
    if entry then
      if x.unpub and redis.call('ZSCORE', x.unpub, names[i]) then
        -- Its reserve is not in Kafka yet (the sweeper republishes it): held on.
        again[#again + 1] = string.format('%d:%s:%s', now + x.ttl, versions[i], names[i])
      else
        local window, hash, name = held_in(x, versions[i], names[i])
        local field, amount = pending_entry_decode(entry)
        field = string.format('%d', field)
        redis.call('HDEL', hash, name)
        -- Its bucket still pending (not aged out, not absorbed away): the amount stays.
        if redis.call('HEXISTS', window, field) == 1 then
          redis.call('HINCRBY', window, PENDING_EXPIRED .. field, string.format('%d', amount))
          marked[window] = true
        end
      end
    end
  end
  if popped > 0 then redis.call('LPOP', x.pekey, popped) end
  if #again > 0 then redis.call('RPUSH', x.pekey, unpack(again)) end
  for window in pairs(marked) do
    redis.call('HSET', window, PENDING_EXPIRED_AT, string.format('%d', now))
  end
end

-- Queue a hold for expiry (see "Expiry"); span: how long its pending window lives. Every
-- EXPIRY_EVERY-th length, the queue's head is looked at.
local function pending_queue_expiry(x, v, entry, now, span, renew)
  if not x.pekey then return end
  local due = string.format('%d:%s:%s', now + x.ttl, v, entry)
  local length = redis.call('RPUSH', x.pekey, due)
  if length == 1 or renew then
    -- It outlives every entry it names (they go with their hash, at the latest).
    redis.call('PEXPIRE', x.pekey, span + x.ttl)
  end
  if length % EXPIRY_EVERY == 0 then pending_expire(x, now) end
end

-- Bucket fields that left the window leave hash, with what expired in them (see "Expiry").
local function pending_prune(hash, fields)
  for i = 1, #fields, 500 do
    local names = {}
    for j = i, math.min(i + 499, #fields) do
      names[#names + 1] = fields[j]
      names[#names + 1] = PENDING_EXPIRED .. fields[j]
    end
    redis.call('HDEL', hash, unpack(names))
  end
end

local function key_hold(x, entry, amount, now)
  pending_prune(x.pwkey, x.stale)
  local q = x.q
  if q.repair then pending_requeue(x) end
  local total = q.total
  if #q.stale > 0 then
    redis.call('LPOP', x.pqkey, q.pop)
    total = total - q.stale_sum
    if total == 0 then
      redis.call('DEL', x.pvkey, x.pqkey)
      q.tail = {}
    else
      pending_prune(x.pvkey, q.stale)
      local first = redis.call('LINDEX', x.pqkey, 0)
      if first then
        redis.call('HSET', x.pvkey, PENDING_HEAD, first)
      else
        redis.call('HDEL', x.pvkey, PENDING_HEAD, PENDING_NEWEST)
      end
      if amount <= 0 or not x.hold_v2 then
        redis.call('HSET', x.pvkey, PENDING_TOTAL, string.format('%d', total))
      end
    end
  end
  if amount <= 0 then return end
  local field = window_pending_field(now, x.bucket)
  local span = x.window + x.bucket
  if x.hold_v2 then
    -- Every key here lives window + bucket past the first amount of its newest bucket:
    -- long enough for every bucket it holds to age out.
    local tail = q.tail
    local newest = tail[#tail]
    local held = nil  -- what the bucket holds already, when read above
    local pushed = not newest or tonumber(newest) < tonumber(field)
    local ends = {}  -- the queue's ends when this hold moves them
    if pushed then
      ends = {PENDING_NEWEST, field}
      if redis.call('RPUSH', x.pqkey, field) == 1 then
        ends = {PENDING_NEWEST, field, PENDING_HEAD, field}
      end
      held = 0
    elseif newest == field then
      if q.tail_amounts then held = q.tail_amounts[#tail] or 0 end
    else
      -- The clock went back a bucket or more (or the policy's bucket narrowed): into its
      -- own bucket when the last entries hold it, else into the newest bucket, which
      -- counts now and leaves the window later than its own (windows.total): never
      -- less, and the queue stays in order (an entry inserted out of order would be
      -- pruned late and its amount subtracted twice).
      if q.fast then tail = redis.call('LRANGE', x.pqkey, -4, -1) end
      local known = false
      for i = #tail, 1, -1 do
        if tail[i] == field then known = true end
      end
      if not known then
        field = newest
        if q.tail_amounts and not q.fast then held = q.tail_amounts[#tail] or 0 end
      end
    end
    local total_text = string.format('%d', total + amount)
    local entry_text = pending_entry_encode(field, amount)
    if held then
      redis.call('HSET', x.pvkey, field, string.format('%d', held + amount), PENDING_TOTAL,
                 total_text, PENDING_ENTRY .. entry, entry_text, unpack(ends))
    else
      redis.call('HINCRBY', x.pvkey, field, string.format('%d', amount))
      redis.call('HSET', x.pvkey, PENDING_TOTAL, total_text, PENDING_ENTRY .. entry, entry_text,
                 unpack(ends))
    end
    if pushed then
      redis.call('PEXPIRE', x.pvkey, span)
      redis.call('PEXPIRE', x.pqkey, span)
    end
    pending_queue_expiry(x, '2', entry, now, span, pushed)
  else
    redis.call('HINCRBY', x.pwkey, field, string.format('%d', amount))
    redis.call('HSET', x.prkey, entry, pending_entry_encode(field, amount))
    redis.call('PEXPIRE', x.pwkey, span)
    redis.call('PEXPIRE', x.prkey, span)
    pending_queue_expiry(x, '1', entry, now, span, true)
  end
end
