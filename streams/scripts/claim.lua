-- CLAIM: claim partitions for this worker (on every assignment, and after a loss of Redis data).
-- Contract: spendgate.streams.scripts.claim
--
-- Each field gets a new fencing token, greater than every earlier owner's; the new owner
-- never claims below the mark Redis holds, and need not apply again what the last owner
-- applied (the position written with the mark).
--
-- Tokens are ordered by the consumer group's generation first (token = generation * 2^20 +
-- a count within it), so they survive a loss of Redis data: after a wipe the owner of the
-- newest generation still holds the higher token whichever worker claims first, and a
-- claim from an older generation than the token held (an old owner that has not seen its
-- partition move yet) is fenced at once: it gets a token below the holder's and changes
-- nothing. Without a generation (0) a claim is the next count, as before.
--
-- KEYS
--   owners      the marks' owners (hash: mark field -> fencing token)
--   marks       the marks (hash: mark field -> watermark ms)
--   positions   the marks' positions (hash: mark field -> next offset to apply, see MARK)
--   presence    this worker's presence mark (set here; gone later: Redis lost its data)
-- ARGV
--   generation  the group generation of this claim (0: none known)
--   field...    the mark fields claimed
-- Reply
--   per field, three values: its new token (integer), the mark Redis holds and the position
--   written with it ("" when missing)
local SPAN = 1048576  -- tokens per generation
redis.call('SET', KEYS[4], '1')
local base = (tonumber(ARGV[1]) or 0) * SPAN
local out = {}
for i = 2, #ARGV do
  local held = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  local token
  if held >= base + SPAN then
    token = base  -- a newer generation holds it: fenced, nothing written
  else
    token = math.max(held + 1, base + 1)
    redis.call('HSET', KEYS[1], ARGV[i], string.format('%d', token))
  end
  out[#out + 1] = token
  out[#out + 1] = redis.call('HGET', KEYS[2], ARGV[i]) or ''
  out[#out + 1] = redis.call('HGET', KEYS[3], ARGV[i]) or ''
end
return out
