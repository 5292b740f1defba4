-- CLAIM: claim partitions for this worker (on every assignment, and after a loss of Redis data).
-- Contract: spendgate.streams.scripts.claim
--
-- Each field gets a new fencing token, greater than every earlier owner's; the new owner
-- never claims below the mark Redis holds, and need not apply again what the last owner
-- applied (the position written with the mark).
--
-- KEYS
--   owners      the marks' owners (hash: mark field -> fencing token)
--   marks       the marks (hash: mark field -> watermark ms)
--   positions   the marks' positions (hash: mark field -> next offset to apply, see MARK)
--   presence    this worker's presence mark (set here; gone later: Redis lost its data)
-- ARGV (1 per field)
--   field       a mark field claimed
-- Reply
--   per field, three values: its new token (integer), the mark Redis holds and the position
--   written with it ("" when missing)
redis.call('SET', KEYS[4], '1')
local out = {}
for i = 1, #ARGV do
  out[#out + 1] = redis.call('HINCRBY', KEYS[1], ARGV[i], 1)
  out[#out + 1] = redis.call('HGET', KEYS[2], ARGV[i]) or ''
  out[#out + 1] = redis.call('HGET', KEYS[3], ARGV[i]) or ''
end
return out
