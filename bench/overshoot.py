"""Overshoot benchmark: 200 concurrent requests against an almost exhausted budget.

spendgate (a real ``spendgate admission`` server and Redis, over loopback HTTP) against a
charge-after-response fixed-window limiter written here, the way common gateways work:
read the window's counter, admit when it is under the limit, serve, then ``INCRBY`` the
actual usage. Both start from the same state (``limit - remaining`` already used) and see
the same 200 requests, all released at once.

Figures: units charged above the limit, admitted, refused, and false refusals (refused
requests that would still have fit under the limit given what was actually charged).

Run: ``.venv/bin/python -m bench.overshoot`` (``--smoke`` for the CI mode, ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _common as c

LIMIT = 100_000
ESTIMATE = {"requests": 1, "input_tokens": 400, "output_tokens": 600}  # 1,000 total tokens
EST_TOTAL = 1_000


@dataclass
class Outcome:
    admitted: int = 0
    refused: int = 0
    charged_actual: int = 0  # usage of the admitted requests, as served
    counter_after: int = 0  # what the limiter's own store holds afterwards
    errors: int = 0


def _actual(rng: random.Random, scenario: str) -> int:
    return EST_TOTAL if scenario == "exact" else rng.randint(EST_TOTAL // 2, EST_TOTAL)


def _split(total: int) -> dict[str, int]:
    return {"requests": 1, "input_tokens": 400, "output_tokens": total - 400}


async def _spendgate(
    port: int, tenant: str, n: int, scenario: str, seed: int, serve_ms: tuple[int, int]
) -> Outcome:
    from bench._http import Conn, get, post

    rng = random.Random(seed)
    out = Outcome()
    conns = [await Conn.open("127.0.0.1", port) for _ in range(n)]
    gate = asyncio.Event()

    async def one(i: int, conn: Conn) -> None:
        body = json.dumps(
            {
                "request_id": f"{tenant}-{i}",
                "subject": {"tenant": tenant, "model": "m"},
                "estimate": ESTIMATE,
            }
        ).encode()
        actual = _actual(rng, scenario)
        pause = rng.uniform(*serve_ms) / 1000
        await gate.wait()
        status, raw = await conn.request(post("/v1/admit", body))
        if status == 429:
            out.refused += 1
            return
        if status != 200:
            out.errors += 1
            return
        out.admitted += 1
        await asyncio.sleep(pause)  # the generation runs
        rid = json.loads(raw)["reservation_id"]
        commit = json.dumps({"reservation_id": rid, "usage": _split(actual)}).encode()
        status, _ = await conn.request(post("/v1/commit", commit))
        if status != 202:
            out.errors += 1
        out.charged_actual += actual

    tasks = [asyncio.create_task(one(i, conn)) for i, conn in enumerate(conns)]
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    _, raw = await conns[0].request(get(f"/v1/budgets?tenant={tenant}&model=m"))
    b = json.loads(raw)["budgets"][0]
    out.counter_after = int(b["used"]) + int(b["reserved"])
    for conn in conns:
        conn.close()
    return out


async def _fixed_window(
    prefix: str,
    tenant: str,
    n: int,
    used: int,
    scenario: str,
    seed: int,
    serve_ms: tuple[int, int],
) -> Outcome:
    import redis.asyncio as aioredis

    rng = random.Random(seed)
    out = Outcome()
    client = aioredis.Redis.from_url(c.REDIS, max_connections=n + 8)
    now = int(time.time())
    key = f"{prefix}fw:{tenant}:{now - now % 3600}"
    await client.set(key, used, ex=7200)
    gate = asyncio.Event()

    async def one() -> None:
        actual = _actual(rng, scenario)
        pause = rng.uniform(*serve_ms) / 1000
        await gate.wait()
        if int(await client.get(key) or 0) >= LIMIT:  # check: counter < limit
            out.refused += 1
            return
        out.admitted += 1
        await asyncio.sleep(pause)  # serve
        await client.incrby(key, actual)  # charge after the response
        out.charged_actual += actual

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    out.counter_after = int(await client.get(key) or 0)
    await client.aclose()
    return out


async def _prefill(rid: str, tenants: list[str], used: int) -> None:
    import redis.asyncio as aioredis

    from spendgate.schemas import window_codec
    from spendgate.schemas.policies import Policy
    from spendgate.schemas.redis_keys import window_key
    from spendgate.streams.materialize import RedisMaterializer
    from spendgate.streams.settings import WorkerSettings
    from spendgate.streams.topics import ensure_topics

    await ensure_topics(
        WorkerSettings(kafka_bootstrap=c.KAFKA, topic_prefix=f"{rid}.", partitions=1)
    )
    policy = Policy.model_validate(
        {
            "id": "ovs",
            "match": {"model": "m"},
            "group_by": ["tenant"],
            "unit": "total_tokens",
            "limit": LIMIT,
            "window": "1h",
            "bucket": "1m",
        }
    )
    client = aioredis.Redis.from_url(c.REDIS)
    try:
        await RedisMaterializer(client, f"{rid}:").stand_in([policy], c.STAND_IN, 2**52)
        now_ms = int(time.time() * 1000)
        head = now_ms - now_ms % 60_000
        # The used amount spread over the last 10 minutes (stays in the 1 h window).
        buckets = {head - k * 60_000: used // 10 for k in range(10)}
        buckets[head] += used - sum(buckets.values())
        for tenant in tenants:
            await client.set(
                window_key(f"{rid}:", f"ovs|tenant={tenant}"),
                window_codec.encode(buckets, 60_000),
                px=7_200_000,
            )
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.overshoot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="concurrent requests per trial")
    ap.add_argument("--remaining", type=int, default=5_000, help="units left under the limit")
    ap.add_argument("--trials", type=int, default=5, help="trials per scenario")
    ap.add_argument("--smoke", action="store_true", help="one short trial per scenario")
    c.add_check_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.trials = 1
    serve_ms = (5, 50)
    used = LIMIT - args.remaining
    rid = c.run_id("ovs")
    c.print_header(
        "overshoot benchmark",
        {
            "limit": LIMIT,
            "already_used": used,
            "remaining": args.remaining,
            "estimate": EST_TOTAL,
            "concurrent_requests": args.requests,
            "trials": args.trials,
            "serve_ms": serve_ms,
            "scenarios": {
                "exact": "actual == estimate",
                "variable": "actual uniform in [50%, 100%] of estimate",
            },
            "run": rid,
        },
    )
    scenarios = ("exact", "variable")
    tenants = [f"{s}{t}" for s in scenarios for t in range(args.trials)]
    asyncio.run(_prefill(rid, tenants, used))
    port = c.free_port()
    env = {
        "SPENDGATE_KAFKA_BOOTSTRAP": c.KAFKA,
        "SPENDGATE_REDIS_URL": c.REDIS,
        "SPENDGATE_TOPIC_PREFIX": f"{rid}.",
        "SPENDGATE_REDIS_PREFIX": f"{rid}:",
        "SPENDGATE_ADMISSION_PORT": str(port),
    }
    rows: list[list[Any]] = []
    worst = {"spendgate": 0, "fixed-window": 0}
    tmp = Path(tempfile.mkdtemp(prefix=f"{rid}-"))
    try:
        with c.process([c.python(), "-m", "spendgate", "admission"], env, tmp / "admission.log"):
            c.wait_http(port, "/readyz")
            for scenario in scenarios:
                for t in range(args.trials):
                    tenant = f"{scenario}{t}"
                    seed = 1000 + t
                    for name, coro in (
                        (
                            "spendgate",
                            _spendgate(port, tenant, args.requests, scenario, seed, serve_ms),
                        ),
                        (
                            "fixed-window (baseline)",
                            _fixed_window(
                                f"{rid}:", tenant, args.requests, used, scenario, seed, serve_ms
                            ),
                        ),
                    ):
                        o = asyncio.run(coro)
                        over = max(0, used + o.charged_actual - LIMIT)
                        room = max(0, LIMIT - used - o.charged_actual)
                        false_refusals = min(o.refused, room // EST_TOTAL)
                        key = "spendgate" if name == "spendgate" else "fixed-window"
                        worst[key] = max(worst[key], over)
                        rows.append(
                            [
                                scenario,
                                t,
                                name,
                                o.admitted,
                                o.refused,
                                o.charged_actual,
                                over,
                                false_refusals,
                                o.counter_after,
                                o.errors,
                            ]
                        )
    finally:
        c.delete_redis_prefix(c.REDIS, f"{rid}:")
        c.delete_topics(c.KAFKA, f"{rid}.")
    print()
    c.print_table(
        [
            "scenario",
            "trial",
            "limiter",
            "admitted",
            "refused",
            "units charged (actual)",
            "units over limit",
            "false refusals",
            "limiter's counter after",
            "errors",
        ],
        rows,
    )
    print()
    print(
        f"targets: spendgate units over the limit, worst trial = {worst['spendgate']} "
        f"(target 0: {c.verdict(worst['spendgate'] == 0, 'overshoot 0')}); baseline "
        f"fixed-window worst = {worst['fixed-window']} units over"
    )
    spendgate_errors = sum(r[9] for r in rows if r[2] == "spendgate")
    print(
        f"         spendgate requests answered neither 200/202 nor 429: {spendgate_errors} "
        f"(target 0, else the figures are incomplete: "
        f"{c.verdict(spendgate_errors == 0, 'no errors')})"
    )
    return c.exit_status(args.check)


if __name__ == "__main__":
    sys.exit(main())
