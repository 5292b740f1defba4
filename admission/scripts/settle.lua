-- SETTLE: settle an open reservation once: a commit or a release, never both.
-- Contract: spendgate.admission.scripts.settle
--
-- KEYS
--   record   the reservation record (written by ADMIT)
-- ARGV
--   kind     "commit" or "release"
-- Reply
--   status   "missing" (no such record: expired or never held), "ok" (first settle, or a
--            repeat of the same kind), or "conflict:<kind>" (settled the other way)
--   subject  the record's subject (JSON), "" when missing
--! include spendgate.schemas:redis_values

local subject = record_subject(KEYS[1])
if not subject then return {'missing', ''} end
local settled = record_settled(KEYS[1])
if settled and settled ~= ARGV[1] then return {'conflict:' .. settled, subject} end
if not settled then record_settle(KEYS[1], ARGV[1]) end
return {'ok', subject}
