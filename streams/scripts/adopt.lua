-- ADOPT: take fencing tokens issued by CLAIM on another copy of the marks (a Redis Cluster).
-- Contract: spendgate.streams.scripts.adopt
--
-- On a cluster every virtual shard keeps its own copy of the marks, beside the windows it
-- vouches for. A worker claims its partitions on the first shard's copy (CLAIM issues the
-- tokens there) and adopts the same tokens on every other copy, so each copy fences an
-- earlier owner from the moment of the claim, as one Redis does. A copy never lowers an
-- owner's token: where a newer owner already holds a higher one, that one stays (this
-- worker's writes there are fenced).
--
-- KEYS
--   owners      this copy's owners (hash: mark field -> fencing token)
--   presence    this worker's presence mark on this copy (set here; gone later: the shard
--               lost its data)
-- ARGV (2 per field)
--   field       a mark field claimed
--   token       the token CLAIM issued for it
-- Reply
--   per field, the token this copy holds now (greater than the one given: fenced)
redis.call('SET', KEYS[2], '1')
local out = {}
for i = 1, #ARGV, 2 do
  local field, token = ARGV[i], tonumber(ARGV[i + 1])
  local held = tonumber(redis.call('HGET', KEYS[1], field) or '-1')
  if token > held then
    redis.call('HSET', KEYS[1], field, ARGV[i + 1])
    held = token
  end
  out[#out + 1] = held
end
return out
