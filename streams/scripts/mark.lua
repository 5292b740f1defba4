-- MARK: write applied marks, fenced, unless Redis lost its data since this worker claimed them.
-- Contract: spendgate.streams.scripts.mark
--
-- A write is fenced when its token is below the owner's in Redis; a watermark not above the
-- one held under the same token is left as it is. A fenced write writes nothing (no
-- watermark, progress or position).
--
-- KEYS
--   marks       the marks (hash: mark field -> watermark ms)
--   owners      the marks' owners (hash: mark field -> fencing token, see CLAIM)
--   progress    the marks' progress (hash: mark field -> "<records behind>:<Redis ms>")
--   positions   the marks' positions (hash: mark field -> next offset to apply: every
--               record of the partition before it is applied in Redis; only ever raised)
--   presence    this worker's presence mark (gone: Redis lost its data; restore, claim
--               again)
-- ARGV (5 per mark written)
--   field       the mark field
--   token       its owner's fencing token
--   watermark   the watermark ms, or "" to leave it
--   behind      the records its owner is behind, or "" for unknown
--   position    the next offset to apply, or "" for unknown
-- Reply
--   {1, or 0 when the presence mark is gone (nothing written); marks written; writes fenced}
if redis.call('EXISTS', KEYS[5]) == 0 then return {0, 0, 0} end
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local written, fenced = 0, 0
for i = 1, #ARGV, 5 do
  local field, token, w, behind = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local position = ARGV[i + 4]
  local owner = tonumber(redis.call('HGET', KEYS[2], field) or '-1')
  if token < owner then
    fenced = fenced + 1
  else
    if w ~= '' then
      local have = tonumber(redis.call('HGET', KEYS[1], field) or '-1')
      if token > owner or tonumber(w) > have then
        redis.call('HSET', KEYS[1], field, w)
        redis.call('HSET', KEYS[2], field, token)
        written = written + 1
      end
    end
    if behind ~= '' then redis.call('HSET', KEYS[3], field, behind .. ':' .. now) end
    if position ~= '' then
      local was = tonumber(redis.call('HGET', KEYS[4], field) or '-1')
      if tonumber(position) > was then redis.call('HSET', KEYS[4], field, position) end
    end
  end
end
return {1, written, fenced}
