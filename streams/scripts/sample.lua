-- SAMPLE: the Redis clock and the usage marks at one instant (streams/marks.py: upstream samples).
-- Contract: spendgate.streams.scripts.sample
--
-- KEYS
--   marks       the marks (hash: mark field -> watermark ms)
-- ARGV (1 per field, at least one)
--   field       a usage mark field
-- Reply
--   {now ms (integer), then one mark per field ("" when missing)}
local t = redis.call('TIME')
local out = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
local marks = redis.call('HMGET', KEYS[1], unpack(ARGV))
for i = 1, #ARGV do out[i + 1] = marks[i] or '' end
return out
