"""Paired A/B of two checkouts' ADMIT scripts in Redis: is this one's Lua slower?

Both scripts run on the same Redis, on the same keys, with the same KEYS and ARGV (built
by this checkout's contract, :class:`spendgate.admission.scripts.admit.AdmitCall`; the
other checkout's script must read the same layout, which the first call checks by
comparing both replies). Each round runs a block of calls of one script, then of the
other (which goes first alternates), and reads Redis's own time for each block from
``INFO commandstats`` (``cmdstat_evalsha``: nothing else runs scripts meanwhile). Figures:
Redis microseconds per call, per script, for windows of 1 h and 24 h in 1 min buckets
prefilled dense, 1 and 5 budgets, admitted (limits far above the usage) and refused (the
usage already over), beside a bare ``EVALSHA`` of ``return 1`` measured in the same
rounds (the floor of any script call).

Run: ``.venv/bin/python -m bench.admit_script_ab --against ../old-checkout``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench import _common as c
from spendgate.admission.scripts import admit
from spendgate.admission.scripts.admit import AdmitCall, AdmitHeader, AdmitTarget
from spendgate.schemas import window_codec
from spendgate.schemas.redis_keys import (
    marks_key,
    pending_reservations_key,
    pending_window_key,
    request_key,
    reservation_key,
    unpublished_reserves_key,
    window_key,
)

BUCKET_MS = 60_000
#: (label, window ms): the benchmark's 1 h window and the seed's rolling 24 h one.
WINDOWS = (("1h", 3_600_000), ("24h", 86_400_000))
BARE = "return 1"
MARK = "bench-mark"


@dataclass(frozen=True)
class Case:
    window: str
    window_ms: int
    budgets: int
    phase: str  # admitted | refused


def _old_source(checkout: Path) -> str:
    """The other checkout's ADMIT, as its own code builds it (new layout, then old)."""
    probe = (
        "import sys\n"
        "try:\n"
        "    from spendgate.admission.scripts.admit import SCRIPT\n"
        "    sys.stdout.write(SCRIPT.source)\n"
        "except ImportError:\n"
        "    from admission.scripts import ADMIT\n"
        "    sys.stdout.write(ADMIT)\n"
    )
    python = checkout / ".venv" / "bin" / "python"
    out = subprocess.run(
        [str(python), "-c", probe], cwd=checkout, capture_output=True, text=True, check=True
    )
    return out.stdout


def _prefill(client: redis.Redis, prefix: str, case: Case, now_ms: int) -> list[str]:
    """Dense windows of 100 per bucket on each key; the budget keys."""
    head = now_ms - now_ms % BUCKET_MS
    n = case.window_ms // BUCKET_MS
    value = window_codec.encode({head - k * BUCKET_MS: 100 for k in range(n)}, BUCKET_MS)
    keys = [f"p{j}|{case.window}|{case.phase}|{case.budgets}" for j in range(case.budgets)]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.set(window_key(prefix, key), value)
    pipe.hset(marks_key(prefix), MARK, 2**52)
    pipe.execute()
    return keys


def _call(prefix: str, case: Case, keys: list[str], rid: str) -> tuple[list[str], list[Any]]:
    """One admit's KEYS and ARGV through this checkout's contract."""
    used = 100 * (case.window_ms // BUCKET_MS)
    limit = used * 1000 if case.phase == "admitted" else used // 2
    call = AdmitCall(
        request_key(prefix, "t", rid),
        reservation_key(prefix, rid),
        unpublished_reserves_key(prefix),
        marks_key(prefix),
    )
    call.plan('{"tenant":"t"}', len(keys))
    for key in keys:
        target = AdmitTarget(
            limit=limit,
            window_ms=case.window_ms,
            bucket_ms=BUCKET_MS,
            boundary="include",
            amount=10,
            reservation_ttl_ms=900_000,
            observe=False,
            on_exceed=0,
            downgrade_plan=0,
            cap_s=0,
            cap_r=1,
            cap_d=1,
            deps=(1,),
            failure=0,
        )
        call.target(
            window_key(prefix, key),
            pending_window_key(prefix, key),
            pending_reservations_key(prefix, key),
            None,
            target.argv(),
        )
    header = AdmitHeader(
        read_only=False,
        reservation_id=rid,
        idempotency_ttl_ms=60_000,
        record_ttl_ms=60_000,
        estimate_output_tokens=10,
        estimate_json='{"output_tokens":10}',
        plans=1,
        staleness_ms=2**53,
        marks=(MARK,),
    )
    return call.finish(header)


def _decision(reply: list[Any]) -> list[Any]:
    """A reply without what depends on the instant it ran (now_ms, retry_after_ms, each
    reset_after)."""
    out = list(reply)
    out[2] = out[3] = None
    for j in range(int(out[7])):
        out[8 + 6 * j + 4] = None
    return out


def _usec(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("usec", 0)), int(stats.get("calls", 0))


def _block(
    client: redis.Redis, sha: str, calls: list[tuple[list[str], list[Any]]], tries: int = 3
) -> float:
    """Redis us per call of ``calls`` run through ``sha``, in pipelines of 50; a block in
    which another client ran a script too is measured again (``tries`` times at most)."""
    for _ in range(tries):
        before, n0 = _usec(client)
        for first in range(0, len(calls), 50):
            pipe = client.pipeline(transaction=False)
            for keys, args in calls[first : first + 50]:
                pipe.evalsha(sha, len(keys), *keys, *args)
            pipe.execute()
        after, n1 = _usec(client)
        if n1 - n0 == len(calls):
            return (after - before) / len(calls)
    raise RuntimeError(f"another client kept running scripts during {tries} blocks")


def _reset(client: redis.Redis, prefix: str) -> None:
    for pattern in ("pw:", "pr:", "req:", "res:", "unpub"):
        c.delete_redis_prefix(c.REDIS, f"{prefix}{pattern}")


def main() -> None:
    ap = argparse.ArgumentParser(prog="bench.admit_script_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--against", required=True, help="the other checkout (with its .venv)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per case")
    ap.add_argument("--calls", type=int, default=400, help="calls per script per round")
    ap.add_argument("--smoke", action="store_true", help="one short round per case")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.calls = 1, 50
    client = redis.Redis.from_url(c.REDIS)
    sources = {"this": admit.SCRIPT.source, "against": _old_source(Path(args.against))}
    shas = {name: client.script_load(src) for name, src in sources.items()}
    bare = client.script_load(BARE)
    prefix = f"{c.run_id('lua')}:"
    print("== ADMIT script A/B (Redis time per call, same keys and arguments)")
    print(f"machine: {json.dumps(c.machine())}")
    params = {"against": args.against, "rounds": args.rounds, "calls": args.calls}
    print(f"params:  {json.dumps(params)}")
    rows = []
    try:
        for label, window_ms in WINDOWS:
            for budgets in (1, 5):
                for phase in ("admitted", "refused"):
                    case = Case(label, window_ms, budgets, phase)
                    keys = _prefill(client, prefix, case, int(time.time() * 1000))
                    probe = _call(prefix, case, keys, "probe")
                    replies = {}
                    for name, sha in shas.items():
                        _reset(client, prefix)
                        replies[name] = client.evalsha(sha, len(probe[0]), *probe[0], *probe[1])
                    assert _decision(replies["this"]) == _decision(replies["against"]), (
                        f"the scripts disagree: {replies}"
                    )
                    per: dict[str, list[float]] = {"this": [], "against": [], "bare": []}
                    for r in range(args.rounds):
                        order = ["this", "against"] if r % 2 == 0 else ["against", "this"]
                        for name in order:
                            _reset(client, prefix)
                            calls = [
                                _call(prefix, case, keys, uuid.uuid4().hex)
                                for _ in range(args.calls)
                            ]
                            per[name].append(_block(client, shas[name], calls))
                        per["bare"].append(_block(client, bare, [([], [])] * args.calls))
                    ratios = [t / a for t, a in zip(per["this"], per["against"], strict=True)]
                    row = {
                        "window": label,
                        "budgets": budgets,
                        "phase": phase,
                        "this_us": statistics.median(per["this"]),
                        "against_us": statistics.median(per["against"]),
                        "bare_us": statistics.median(per["bare"]),
                        "ratio": statistics.median(ratios),
                        "ratio_range": (min(ratios), max(ratios)),
                    }
                    rows.append(row)
                    print(
                        f"  {label:>3} {budgets} budget(s) {phase:8} this {row['this_us']:7.1f} us"
                        f"  against {row['against_us']:7.1f} us  bare {row['bare_us']:5.1f} us"
                        f"  this/against {row['ratio']:.3f}"
                    )
    finally:
        _reset(client, prefix)
        c.delete_redis_prefix(c.REDIS, prefix)
        client.close()
    print()
    print(
        "| window | budgets | requests | this us/call | against us/call | bare EVALSHA us "
        "| this/against (median) | per-round |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["ratio_range"]
        print(
            f"| {r['window']} / 1 min | {r['budgets']} | {r['phase']} | {r['this_us']:,.1f} "
            f"| {r['against_us']:,.1f} | {r['bare_us']:.1f} | **{r['ratio']:.3f}** "
            f"| {lo:.3f}-{hi:.3f} |"
        )


if __name__ == "__main__":
    main()
