-- CLAIM_UNPUBLISHED: claim the unpublished reserves older than a grace period, to republish.
-- Contract: spendgate.admission.scripts.claim_unpublished
--
-- A claimed entry is re-scored to now: no other process claims it again before another
-- grace period has passed, by which time this one has published it (and removed it on the
-- broker's ack) or died, in which case the next claim republishes it; and the same sweep
-- never takes it twice, since now is never before the sweep's cutoff. Time is the Redis
-- server clock, the same clock that scored the entries.
--
-- KEYS
--   unpublished   the unpublished reserves (sorted set: reservation id -> ms, see ADMIT)
-- ARGV
--   grace         ms
--   most          the most entries to claim
--   cutoff        the cutoff this sweep's first claim returned, "" on a sweep's first claim
-- Reply
--   cutoff, then the claimed reservation ids oldest first: the entries scored before the
--   cutoff (now - grace on the first claim of a sweep, kept for the rest of that sweep)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - tonumber(ARGV[1])
if ARGV[3] ~= '' then cutoff = tonumber(ARGV[3]) end
cutoff = string.format('%d', cutoff)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. cutoff, 'LIMIT', 0,
                       tonumber(ARGV[2]))
local stamp = string.format('%d', now)
for i = 1, #ids, 500 do
  local args = {}
  for j = i, math.min(i + 499, #ids) do
    args[#args + 1] = stamp
    args[#args + 1] = ids[j]
  end
  redis.call('ZADD', KEYS[1], 'XX', unpack(args))
end
table.insert(ids, 1, cutoff)
return ids
