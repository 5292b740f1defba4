-- HEAL: rewrite one window that differs from the worker's table, unless a newer one was written.
-- Contract: spendgate.streams.scripts.heal
--
-- A matching window whose version is behind is not drift: records that move the version
-- without changing the window (a commit of exactly its reservation, a duplicate) are not
-- written to Redis, so only the version is brought forward.
--
-- KEYS
--   window        the window (string, schemas/window_codec.py layout)
--   version       the window's version (string)
--   utilization   the utilization index (sorted set: window key -> total / limit, see ABSORB)
-- ARGV
--   window        the window as the worker's table holds it
--   px            the PX (ms) of the window and its version
--   version       its version
--   score         its utilization score, or "" for none (set with the window it belongs to)
-- Reply
--   1 when the window was rewritten, 0 when it matched or Redis holds a newer one
local have = tonumber(redis.call('GET', KEYS[2]) or '-1')
if have > tonumber(ARGV[3]) then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if have < tonumber(ARGV[3]) then redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2]) end
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[3], ARGV[4], KEYS[1]) end
return 1
