-- ABSORB: write windows and move the reservations they now hold out of their pending windows.
-- Contract: spendgate.streams.scripts.absorb
--
-- Each budget key in one atomic step: at no instant does a reservation count twice or not at
-- all.
--
-- Each window is a compare-and-set on its version: a worker that lost the key's partition
-- in a rebalance (its last batch still in flight, or itself dropped from the group while
-- folding) must not overwrite what the partition's new owner wrote since. A version is the
-- key's applied records by position (KeyState.version), so the newer write has the higher
-- one; an equal version holds the same records.
--
-- A window written also sets its score in the utilization index (the dashboard's top-N):
-- one ZADD per key, under the same compare-and-set, so a stale writer moves neither.
--
-- A reservation with no record was never pending here, or its record went with its
-- bucket's age; either way nothing of it counts in the pending window any more. Absorbing
-- is idempotent, so a stale writer's ids are absorbed too (the newer window holds them).
--
-- A reservation held in the version-2 pending window (its entry in that hash, under
-- "r:" + id) leaves its bucket's field and the window's sum together; when the sum reaches
-- 0 nothing is pending and the hash and its queue go (the admit script starts them again).
--
-- KEYS (7 per budget key)
--   window                the window (string, schemas/window_codec.py layout)
--   pending window        version 1: hash: a bucket's last ms -> amount pending there
--   pending v2            version 2: the same fields, plus their sum 't' and each
--                         reservation's pending entry under "r:" + id
--   queue                 the version-2 window's bucket fields, oldest first (list)
--   pending reservations  version 1: hash: reservation id -> its pending entry
--                         "<field>:<amount>" (schemas/redis_values.py)
--   version               the window's version (string)
--   utilization           the utilization index (sorted set: window key -> total / limit,
--                         schemas/redis_keys.py utilization_key)
-- ARGV (5 + n per budget key)
--   window                the window's new value, or "" to leave it as it is
--   px                    the PX (ms) of the window and its version
--   version               the window's version, or "" for none (no compare)
--   score                 its utilization score, or "" for none
--   n                     how many reservation ids follow
--   ids                   n reservation ids whose reserve the window now holds (or never
--                         will: a late or settled reserve)
-- Reply
--   the pending amount moved out, over every budget key (integer)
--! include spendgate.schemas:redis_values
local moved = 0
local a = 1
for k = 1, #KEYS, 7 do
  local wkey, pwkey, pvkey, pqkey, prkey = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3],
    KEYS[k + 4]
  local window, px, version, score = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local n = tonumber(ARGV[a + 4])
  local newer = false
  if version ~= '' then
    local have = tonumber(redis.call('GET', KEYS[k + 5]) or '-1')
    newer = have > tonumber(version)
    if not newer then redis.call('SET', KEYS[k + 5], version, 'PX', px) end
  end
  if window ~= '' and not newer then
    redis.call('SET', wkey, window, 'PX', px)
    if score ~= '' then redis.call('ZADD', KEYS[k + 6], score, wkey) end
  end
  for i = a + 5, a + 4 + n do
    local v2name = 'r:' .. ARGV[i]
    local found = {redis.call('HGET', prkey, ARGV[i]), redis.call('HGET', pvkey, v2name)}
    for version_index = 1, 2 do
      local record = found[version_index]
      if record then
        local name, hash, entries = ARGV[i], pwkey, prkey
        if version_index == 2 then name, hash, entries = v2name, pvkey, pvkey end
        redis.call('HDEL', entries, name)
        local field, amount = pending_entry_decode(record)
        -- As text, exact (tostring writes a number of 15+ digits with an exponent).
        field = string.format('%d', field)
        local held = tonumber(redis.call('HGET', hash, field) or '0')
        if held > amount then
          redis.call('HINCRBY', hash, field, string.format('%d', -amount))
        else
          -- Pruned (its bucket left the window) or exactly this amount: nothing stays.
          redis.call('HDEL', hash, field)
        end
        local left = math.min(held, amount)
        if version_index == 2 and left > 0 then
          local sum = redis.call('HINCRBY', hash, 't', string.format('%d', -left))
          if sum <= 0 then redis.call('DEL', pvkey, pqkey) end
        end
        moved = moved + left
      end
    end
  end
  a = a + 5 + n
end
return moved
