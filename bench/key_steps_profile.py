"""Where the admit script's time per budget key goes: each per-key step, timed inside Redis.

The ADMIT script's per-key work is the libraries' steps (``admission/scripts/key_steps.lua``)
plus the script's own parsing and answer. This runs each step ``--repeat`` times in one
script call, on one dense window, and reads the Redis clock (``TIME``, microseconds)
between steps, so the figures are Redis's own time for the step with no round trip and
no script call around it:

* ``parse``: a target's 15 ARGV entries into its table, and its mark state (as ADMIT);
* ``load``: ``key_load`` (the window read in place, the pending windows' state);
* ``reset``: ``key_reset_after``; ``retry``: ``key_retry_after`` against a limit the
  window is over (a refusal's Retry-After);
* ``hold``: ``key_hold`` of one reservation (the pending window's write; the reads
  before it all see the state the run started from);
* ``answer``: the 6 reply values of a target, and ``encode``: their stored-answer text.

Each window is profiled with no reservation pending and with reservations pending in the
newest bucket (what an admit meets while the worker has not absorbed yet). Baseline in the
same run: one ``EXISTS`` call from Lua (the cost of any ``redis.call``). Windows: 1 h and
24 h of 1 min buckets, 31 d of 1 h, prefilled dense.

Run: ``.venv/bin/python -m bench.key_steps_profile`` (``--smoke`` for the CI mode).
"""

from __future__ import annotations

import argparse
import time
import uuid

import redis

from bench import _common as c
from spendgate.schemas import window_codec
from spendgate.schemas.luascript import compose
from spendgate.schemas.redis_keys import held_keys

WINDOWS = {
    "1h": (3_600_000, 60_000),
    "24h": (86_400_000, 60_000),
    "31d": (31 * 86_400_000, 3_600_000),
}
STEPS = ("parse", "load", "reset", "retry", "hold", "answer", "encode", "redis.call")

PROFILE = """--! include spendgate.schemas:window
--! include spendgate.schemas:window_view
--! include spendgate.schemas:burst
--! include spendgate.schemas:redis_values
--! include spendgate.admission.scripts:key_steps
local now, N = tonumber(ARGV[1]), tonumber(ARGV[4])
local function us() local t = redis.call('TIME') return tonumber(t[1]) * 1e6 + tonumber(t[2]) end
local A = {'1000', ARGV[2], ARGV[3], 'include', '10', '900000', '0', '0', '0', '0', '1', '1',
           '1', '1', ''}
local xs, out = {}, {}
local t0 = us()
for i = 1, N do
  xs[i] = {wkey = KEYS[1], pwkey = KEYS[2], pvkey = KEYS[3], pqkey = KEYS[4], prkey = KEYS[5],
    pekey = KEYS[6],
    limit = tonumber(A[1]), window = tonumber(A[2]), bucket = tonumber(A[3]), boundary = A[4],
    amount = tonumber(A[5]), ttl = tonumber(A[6]), observe = A[7] == '1',
    on_exceed = tonumber(A[8]), alt = tonumber(A[9]), cap_s = tonumber(A[10]),
    cap_r = tonumber(A[11]), cap_d = tonumber(A[12]), failure = tonumber(A[14]),
    state = key_state(A[13], {0})}
end
out[1] = us() - t0
t0 = us()
for i = 1, N do key_load(xs[i], now) end
out[2] = us() - t0
t0 = us()
for i = 1, N do key_reset_after(xs[i], now, 10) end
out[3] = us() - t0
t0 = us()
for i = 1, N do key_retry_after(xs[i], now) end
out[4] = us() - t0
t0 = us()
for i = 1, N do key_hold(xs[i], 'p' .. i, 10, now) end
out[5] = us() - t0
local answer = {}
t0 = us()
for i = 1, N do
  local x = xs[i]
  answer[#answer + 1] = x.used
  answer[#answer + 1] = x.reserved
  answer[#answer + 1] = 10
  answer[#answer + 1] = 1
  answer[#answer + 1] = 5000
  answer[#answer + 1] = x.state
end
out[6] = us() - t0
t0 = us()
answer_encode(answer)
out[7] = us() - t0
t0 = us()
for i = 1, N do redis.call('EXISTS', KEYS[2]) end
out[8] = us() - t0
return out
"""


def profile(client: redis.Redis, window: str, pending: bool, repeat: int) -> dict[str, float]:
    window_ms, bucket_ms = WINDOWS[window]
    prefix = f"{c.run_id('ksp')}-{uuid.uuid4().hex[:6]}:"
    now = int(time.time() * 1000)
    head = now - now % bucket_ms
    keys = list(held_keys(prefix, "k"))
    client.set(
        keys[0],
        window_codec.encode(
            {head - k * bucket_ms: 100 for k in range(window_ms // bucket_ms)}, bucket_ms
        ),
    )
    source = compose(PROFILE)
    try:
        best: dict[str, float] = {}
        for _ in range(3):  # the least disturbed of three
            # Every step reads the same state: the holds of a run go before the next one.
            client.delete(*keys[1:])
            if pending:  # reservations held in the newest bucket, not absorbed
                client.eval(source, len(keys), *keys, now, window_ms, bucket_ms, 20)
            got = client.eval(source, len(keys), *keys, now, window_ms, bucket_ms, repeat)
            for step, total in zip(STEPS, got, strict=True):
                value = total / repeat
                best[step] = min(best.get(step, value), value)
        return best
    finally:
        c.delete_redis_prefix(c.REDIS, prefix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench.key_steps_profile", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--repeat", type=int, default=200, help="times each step runs per script call")
    ap.add_argument("--smoke", action="store_true", help="a tiny run (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeat = 5
    client = redis.Redis.from_url(c.REDIS)
    c.print_header("per-key steps of the admit script, timed inside Redis", {"repeat": args.repeat})
    print("| window | pending | " + " | ".join(f"{s} us" for s in STEPS) + " | sum of steps us |")
    print("|---" * (len(STEPS) + 3) + "|")
    for window in WINDOWS:
        for pending in (False, True):
            p = profile(client, window, pending, args.repeat)
            per_key = sum(p[s] for s in ("parse", "load", "reset", "hold", "answer", "encode"))
            cells = " | ".join(f"{p[s]:.2f}" for s in STEPS)
            print(f"| {window} | {'yes' if pending else 'no'} | {cells} | {per_key:.1f} |")
    print("(sum of steps: parse + load + reset + hold + answer + encode, an admitted key's work;")
    print(" retry is a refused key's instead of hold; redis.call: one EXISTS, the baseline)")
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
