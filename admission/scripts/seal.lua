-- SEAL: the commit point of a reservation whose keys span shards (admission.shards).
-- Contract: spendgate.admission.scripts.seal
--
-- Run on the request's home shard once every shard's piece has held its part. Exactly one
-- of "sealed" and "tombstoned" ever happens to a reservation id: a sweeper that finds a
-- piece past its deadline writes the tombstone here before it releases the piece, and
-- this step refuses once the tombstone exists; a sealed reservation's record is what the
-- sweeper finds instead. A request id answered before (a retry that raced this one) gets
-- that answer back and seals nothing: the caller releases its own pieces.
--
-- KEYS
--   answer        the stored answer of this request id (schemas/redis_values.py)
--   record        the reservation record (schemas/redis_values.py: ReservationRecord)
--   unpublished   the unpublished reserves (sorted set: reservation id -> admission ms)
--   tombstone     the reservation's tombstone (written by a sweeper: aborted)
--   provisional   this shard's provisional set (its own piece's entry, when it has one)
--   piece         this shard's piece record of the reservation (when it has one)
-- ARGV
--   reservation   the reservation id
--   answer        the merged answer (schemas/redis_values.py: encode_answer)
--   answer_ttl    ms the stored answer lives
--   subject, plan, usage, at, out, ttl   the record's fields (ReservationRecord)
--   record_ttl    ms the record lives
-- Reply
--   0 sealed; 1 tombstoned (nothing written); or 2 then the stored answer's values (text)
--! include spendgate.schemas:redis_values

local stored = redis.call('GET', KEYS[1])
if stored then
  local out = answer_decode(stored)
  out[1] = 2
  return out
end
if redis.call('EXISTS', KEYS[4]) == 1 then return {1} end
record_write(KEYS[2], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10]))
redis.call('ZADD', KEYS[3], ARGV[7], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('DEL', KEYS[6])
redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
return {0}
