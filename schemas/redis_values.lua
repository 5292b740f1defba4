-- spendgate shared values: the Lua twin of spendgate/schemas/redis_values.py.
-- Library: local functions only; it reads no script keys or arguments and sets no globals.
-- Provides:
--   pending_entry_encode(field, amount) -> "<field>:<amount>"
--   pending_entry_decode(raw) -> field, amount (numbers); raises on another shape
--   answer_encode(values) -> the values joined by ',' (numbers as exact integers)
--   answer_decode(stored) -> {1, values...}: a stored answer as a script returns it
--                            (1: replayed), each value as text
--   record_write(key, subject, plan, usage, at, out, ttl, px): the reservation record
--   record_subject(key) -> the record's subject JSON, or false when it is gone
--   record_settled(key) -> 'commit' | 'release', or false while open (or gone)
--   record_settle(key, kind): mark it settled as kind

-- An exact integer as text (tostring writes one past 14 digits as "2.3706450097985e+15").
local function value_text(v)
  if type(v) == 'number' then return string.format('%d', v) end
  return v
end

local function pending_entry_encode(field, amount)
  return value_text(field) .. ':' .. value_text(amount)
end

local function pending_entry_decode(raw)
  local field, amount = string.match(raw, '^(%d+):(%d+)$')
  if not field then error('spendgate pending entry: not <field>:<amount>: ' .. tostring(raw)) end
  return tonumber(field), tonumber(amount)
end

local function answer_encode(values)
  local parts = {}
  for i = 1, #values do parts[i] = value_text(values[i]) end
  return table.concat(parts, ',')
end

local function answer_decode(stored)
  local out = {1}
  for v in string.gmatch(stored, '([^,]+)') do out[#out + 1] = v end
  return out
end

local function record_write(key, subject, plan, usage, at, out, ttl, px)
  redis.call('HSET', key, 'subject', subject, 'plan', value_text(plan), 'usage', usage,
             'at', value_text(at), 'out', value_text(out), 'ttl', value_text(ttl))
  redis.call('PEXPIRE', key, px)
end

local function record_subject(key)
  return redis.call('HGET', key, 'subject')
end

local function record_settled(key)
  return redis.call('HGET', key, 'settled')
end

local function record_settle(key, kind)
  redis.call('HSET', key, 'settled', kind)
end
