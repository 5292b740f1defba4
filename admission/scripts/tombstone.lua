-- TOMBSTONE: decide a piece left past its deadline on its reservation's home shard.
-- Contract: spendgate.admission.scripts.tombstone
--
-- The sweeper's half of the commit protocol (admission.pieces): either the reservation's
-- record is here (SEAL ran first: sealed, nothing to do but unlist the piece), or the
-- tombstone is set in this same step, so no SEAL can run after it (SEAL refuses once the
-- tombstone exists), and the piece may be released. Run with WAIT behind it, like SEAL: a
-- tombstone a failover lost would let a late SEAL land on a released piece.
--
-- KEYS
--   record      the reservation record (schemas/redis_values.py: ReservationRecord)
--   tombstone   the reservation's tombstone
-- ARGV
--   ttl         ms the tombstone lives (longer than any seal could still be attempted)
-- Reply
--   1 sealed (the record exists; no tombstone written), 0 aborted (the tombstone is set)

if redis.call('EXISTS', KEYS[1]) == 1 then return 1 end
redis.call('SET', KEYS[2], '1', 'PX', tonumber(ARGV[1]))
return 0
