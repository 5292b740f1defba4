"""Admission benchmark: latency and admits/s of a real ``spendgate admission`` server.

Load comes from a separate process on loopback, closed-loop (N connections, each sends
its next request when the previous answer arrived) and open-loop at a fixed rate (latency
measured from each request's *intended* send time, so a stall is charged to every request
it delayed: corrected for coordinated omission). Requests match 1, 5 or 50 budgets.

Baselines measured in the same run:
  (a) ``lua``: the same ADMIT script through ``admission.store.BudgetStore.admit`` with
      the client ``admission.server.redis_client`` builds (plans prebuilt, so only the
      script round trip is timed), from a separate process;
  (b) ``empty``: a FastAPI app with one empty route served by uvicorn with the same
      options as ``spendgate admission`` (``admission.server.uvicorn_options``), and a
      bare ASGI endpoint on the same stack (the server's own cost).
Every spendgate and Lua run also reports what each request cost where it ran, which
contention on a shared machine moves far less than throughput: the admission server's
CPU time per request (``/proc/<pid>/stat``, warm-up included) and Redis's own time per
script calls per request (``INFO commandstats``: the admit script and any the server's
background tasks ran meanwhile). A refused run sends requests that a 1-budget
``reject`` policy refuses every time (its window is already over the limit): the plain
reject path, with everything a refusal does (answer, Retry-After, refusal record).
Also: ``spendgate admission --workers 2`` against the one-process server, and a policy
scale run: one policy per tenant (exact ``match`` on ``tenant``), 10 against 10,000
policies, each on its own server and key prefix, requests spread over every tenant.

Run: ``.venv/bin/python -m bench.admission`` (``--smoke`` for the CI mode, ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from bench import _common as c
from bench import _profile

WINDOW = "1h"
BUCKET = "1m"
ESTIMATE = {"requests": 1, "input_tokens": 100, "output_tokens": 100}


# --------------------------------------------------------------------------- load side


async def _load(spec: dict[str, Any]) -> dict[str, Any]:
    tenants = int(spec["tenants"])
    model = spec["model"]
    tag = spec["tag"]
    pool: asyncio.Queue[Any] = asyncio.Queue()
    if spec["target"] == "lua":
        from spendgate.admission.app import build_plans
        from spendgate.admission.server import redis_client
        from spendgate.admission.settings import AdmissionSettings
        from spendgate.admission.store import BudgetStore
        from spendgate.schemas.events import Subject, Usage

        settings = AdmissionSettings(redis_url=spec["redis_url"], redis_prefix=spec["prefix"])
        client = redis_client(settings)
        store = BudgetStore(
            client, settings.redis_prefix, settings.policy_refresh_s, settings.redis_down_s
        )
        policies = await store.policies()
        est = Usage(**ESTIMATE)
        plans = [
            build_plans(policies, Subject(tenant=f"t{t}", model=model), est, None)
            for t in range(tenants)
        ]
        assert all(len(p[0].charges) == spec["budgets"] for p in plans), "policy mismatch"

        async def call(i: int) -> int:
            r = await store.admit(f"{tag}-{i}", uuid.uuid4().hex, plans[i % tenants], 100)
            return 200 if r.outcome == "allow" else 429

    else:
        from bench._http import Conn, post

        for _ in range(int(spec["connections"])):
            pool.put_nowait(await Conn.open("127.0.0.1", int(spec["port"])))
        est_json = json.dumps(ESTIMATE, separators=(",", ":"))

        async def call(i: int) -> int:
            body = (
                f'{{"request_id":"{tag}-{i}","subject":{{"tenant":"t{i % tenants}",'
                f'"model":"{model}"}},"estimate":{est_json}}}'
            ).encode()
            conn = await pool.get()
            try:
                status, _ = await conn.request(post("/v1/admit", body))
            finally:
                pool.put_nowait(conn)
            return status

    statuses: Counter[str] = Counter()

    async def safe(i: int) -> str:
        try:
            return str(await call(i))
        except Exception as exc:  # noqa: BLE001 - an overloaded target is a result
            return type(exc).__name__

    latencies: list[float] = []
    seconds = float(spec["seconds"])
    cap = int(spec["max_requests"])
    # Warm up (connections, caches, the script cache); not recorded.
    warmup = min(100, cap)
    await asyncio.gather(*(safe(-1 - k) for k in range(warmup)))
    counter = iter(range(cap))
    start = time.perf_counter()
    if spec["mode"] == "closed":
        deadline = start + seconds

        async def worker() -> None:
            for i in counter:
                if time.perf_counter() > deadline:
                    return
                t0 = time.perf_counter()
                status = await safe(i)
                latencies.append(time.perf_counter() - t0)
                statuses[status] += 1

        await asyncio.gather(*(worker() for _ in range(int(spec["concurrency"]))))
        elapsed = time.perf_counter() - start
    else:
        rate = float(spec["rate"])
        tasks: list[asyncio.Task[None]] = []

        async def one(i: int, intended: float) -> None:
            status = await safe(i)
            # From the intended send time: time spent waiting to be sent counts too.
            latencies.append(time.perf_counter() - intended)
            statuses[status] += 1

        for i in counter:
            intended = start + i / rate
            if intended - start > seconds:
                break
            delay = intended - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, intended)))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        elapsed = time.perf_counter() - start
    return {
        "n": len(latencies),
        "sent": len(latencies) + warmup,
        "elapsed_s": elapsed,
        "statuses": dict(statuses),
        "latencies": latencies,
    }


def _load_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = asyncio.run(_load(spec))
    Path(spec["out"]).write_text(json.dumps(result))


# --------------------------------------------------------------------------- orchestration


def _tenant_policies(count: int) -> list[Any]:
    from spendgate.schemas.policies import Policy

    return [
        Policy.model_validate(
            {
                "id": f"pt{i}",
                "match": {"tenant": f"t{i}"},
                "unit": "total_tokens",
                "limit": 10**12,
                "window": WINDOW,
                "bucket": BUCKET,
            }
        )
        for i in range(count)
    ]


#: The refused runs' model: one ``reject`` policy whose prefilled window (60 x 100) is
#: already past its limit, so every request is refused.
REFUSED_MODEL = "mr"


def _policies(budgets: list[int]) -> list[Any]:
    from spendgate.schemas.policies import Policy

    refused = Policy.model_validate(
        {
            "id": "refused-0",
            "match": {"model": REFUSED_MODEL},
            "group_by": ["tenant"],
            "unit": "total_tokens",
            "limit": 1_000,
            "window": WINDOW,
            "bucket": BUCKET,
        }
    )
    return [refused] + [
        Policy.model_validate(
            {
                "id": f"b{n}-{i}",
                "match": {"model": f"m{n}"},
                "group_by": ["tenant"],
                "unit": "total_tokens",
                "limit": 10**12,
                "window": WINDOW,
                "bucket": BUCKET,
            }
        )
        for n in budgets
        for i in range(n)
    ]


async def _prepare(
    rid: str, budgets: list[int], tenants: int, policies: list[Any] | None = None
) -> None:
    """Topics, the policies in Redis, and a 60-bucket (dense) window on every key used
    (``policies``: those instead of ``budgets``' policies, model ``ms``)."""
    import redis.asyncio as aioredis

    from spendgate.schemas import window_codec
    from spendgate.schemas.events import Subject
    from spendgate.schemas.matching import PolicyIndex
    from spendgate.schemas.redis_keys import window_key
    from spendgate.streams.materialize import RedisMaterializer
    from spendgate.streams.settings import WorkerSettings
    from spendgate.streams.topics import ensure_topics

    await ensure_topics(
        WorkerSettings(kafka_bootstrap=c.KAFKA, topic_prefix=f"{rid}.", partitions=1)
    )
    models = [f"m{n}" for n in budgets] + [REFUSED_MODEL]
    if policies is None:
        policies = _policies(budgets)
    else:
        models = ["ms"]
    client = aioredis.Redis.from_url(c.REDIS)
    try:
        await RedisMaterializer(client, f"{rid}:").stand_in(policies, c.STAND_IN, 2**52)
        now_ms = int(time.time() * 1000)
        head = now_ms - now_ms % 60_000
        value = window_codec.encode({head - k * 60_000: 100 for k in range(60)}, 60_000)
        async with client.pipeline(transaction=False) as pipe:
            index = PolicyIndex(policies)
            for model in models:
                for t in range(tenants):
                    for target in index.targets(Subject(tenant=f"t{t}", model=model)):
                        pipe.set(window_key(f"{rid}:", target.key), value, px=7_200_000)
            await pipe.execute()
    finally:
        await client.aclose()


def _absorb(rid: str) -> None:
    """Forget the pending reservations and request records between runs, as the worker
    would absorb them; otherwise each run would scan the last run's pending entries."""
    for pattern in ("pw:", "pr:", "req:", "res:"):
        c.delete_redis_prefix(c.REDIS, f"{rid}:{pattern}")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _script_usec() -> int:
    """Microseconds Redis has spent running scripts so far (its own count)."""
    import redis

    client = redis.Redis.from_url(c.REDIS)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(
        int(stats.get(name, {}).get("usec", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval")
    )


def _run_load(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    name = f"{spec['label']}-{uuid.uuid4().hex[:6]}".replace(" ", "_").replace("/", "_")
    spec_path = tmp / f"{name}.json"
    spec["out"] = str(tmp / f"{name}.out.json")
    spec_path.write_text(json.dumps(spec))
    subprocess.run(
        [c.python(), "-m", "bench.admission", "--load", str(spec_path)],
        check=True,
        cwd=c.ROOT,
        timeout=float(spec["seconds"]) + 120,
    )
    result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    result["label"] = spec["label"]
    result["mode"] = spec["mode"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.admission", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run")
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop requests/s")
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop connections")
    ap.add_argument("--budgets", default="1,5,50", help="budgets matched per request")
    ap.add_argument("--tenants", type=int, default=500, help="distinct tenants (keys/policy)")
    ap.add_argument("--max-requests", type=int, default=200_000, help="cap per run")
    ap.add_argument("--smoke", action="store_true", help="tiny CI run (a few hundred requests)")
    ap.add_argument("--profile", action="store_true", help="py-spy the server under load")
    ap.add_argument(
        "--scale",
        default="10,10000",
        help="policy counts of the per-tenant policy scale run ('' for none)",
    )
    ap.add_argument("--workers", type=int, default=2, help="processes of the multi-process run")
    ap.add_argument("--plots", default=str(c.PLOTS), help="where PNGs go ('' for none)")
    ap.add_argument("--load", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", help=argparse.SUPPRESS)
    c.add_check_flag(ap)
    args = ap.parse_args(argv)
    if args.load:
        _load_main(args.load)
        return 0
    budgets = [int(x) for x in args.budgets.split(",")]
    if args.prepare:
        # bench.admission_ab: each checkout prepares its own prefix with its own code.
        asyncio.run(_prepare(args.prepare, budgets, args.tenants))
        return 0
    if args.smoke:
        args.seconds, args.rate, args.tenants, args.max_requests = 0.5, 200.0, 20, 200
        budgets = [1]
        args.scale = ""
        args.plots = ""
    rid = c.run_id("adm")
    c.print_header(
        "admission benchmark",
        {
            "seconds_per_run": args.seconds,
            "open_loop_rate": args.rate,
            "closed_loop_connections": args.concurrency,
            "budgets": budgets,
            "tenants": args.tenants,
            "window": WINDOW,
            "bucket": BUCKET,
            "prefill": "60 non-empty 1m buckets per key",
            "run": rid,
        },
    )
    tmp = Path(tempfile.mkdtemp(prefix=f"{rid}-"))
    asyncio.run(_prepare(rid, budgets, args.tenants))
    sg_port, empty_port, bare_port = c.free_port(), c.free_port(), c.free_port()
    multi_port = c.free_port()
    scales = [int(x) for x in args.scale.split(",") if x]
    env = {
        "SPENDGATE_KAFKA_BOOTSTRAP": c.KAFKA,
        "SPENDGATE_REDIS_URL": c.REDIS,
        "SPENDGATE_TOPIC_PREFIX": f"{rid}.",
        "SPENDGATE_REDIS_PREFIX": f"{rid}:",
        "SPENDGATE_ADMISSION_PORT": str(sg_port),
    }
    results: list[dict[str, Any]] = []
    profile_lines: list[str] = []
    try:
        with (
            c.process(
                [c.python(), "-m", "spendgate", "admission"], env, tmp / "admission.log"
            ) as server,
            c.process(
                [c.python(), "-m", "bench._empty_app", str(empty_port)], {}, tmp / "empty.log"
            ),
            c.process(
                [c.python(), "-m", "bench._empty_app", str(bare_port), "asgi"],
                {},
                tmp / "bare.log",
            ),
        ):
            c.wait_http(sg_port, "/readyz")
            c.wait_http(empty_port, "/healthz")
            c.wait_http(bare_port, "/healthz")
            base = {
                "seconds": args.seconds,
                "max_requests": args.max_requests,
                "tenants": args.tenants,
                "redis_url": c.REDIS,
                "prefix": f"{rid}:",
                "concurrency": args.concurrency,
                "rate": args.rate,
            }

            def run(
                label: str, target: str, mode: str, n: int, port: int = 0, model: str = ""
            ) -> None:
                spec = {
                    **base,
                    "label": label,
                    "target": target,
                    "mode": mode,
                    "budgets": n,
                    "model": model or f"m{n}",
                    "port": port,
                    "tag": f"{rid}-{uuid.uuid4().hex[:6]}",
                    "connections": args.concurrency if mode == "closed" else 64,
                }
                cpu0 = _cpu_s(server.pid) if port == sg_port else None
                usec0 = _script_usec()
                results.append(_run_load(spec, tmp))
                usec1 = _script_usec()
                last = results[-1]
                if cpu0 is not None:
                    last["server_us"] = 1e6 * (_cpu_s(server.pid) - cpu0) / last["sent"]
                if cpu0 is not None or target == "lua":
                    last["redis_us"] = (usec1 - usec0) / last["sent"]
                _absorb(rid)
                print(
                    f"  ran {label:34s} {mode:6s} n={last['n']:>7,} "
                    f"{last['n'] / last['elapsed_s']:>9,.0f}/s statuses={last['statuses']}",
                    flush=True,
                )

            run("baseline empty endpoint", "http", "closed", 1, empty_port)
            run("baseline bare asgi endpoint", "http", "closed", 1, bare_port)
            for n in budgets:
                run(f"spendgate /v1/admit, {n} budget(s)", "http", "closed", n, sg_port)
                run(f"baseline lua direct, {n} budget(s)", "lua", "closed", n)
            refused = ("closed", 1)
            run("spendgate /v1/admit refused, 1 budget", "http", *refused, sg_port, REFUSED_MODEL)
            run("baseline lua direct refused, 1 budget", "lua", *refused, 0, REFUSED_MODEL)
            run("baseline empty endpoint (again)", "http", "closed", 1, empty_port)
            run("baseline empty endpoint", "http", "open", 1, empty_port)
            run("baseline bare asgi endpoint", "http", "open", 1, bare_port)
            for n in budgets:
                if n > 5:
                    continue
                run(f"spendgate /v1/admit, {n} budget(s)", "http", "open", n, sg_port)
                run(f"baseline lua direct, {n} budget(s)", "lua", "open", n)
            if args.workers > 1:
                with c.process(
                    [
                        c.python(),
                        "-m",
                        "spendgate",
                        "admission",
                        "--workers",
                        str(args.workers),
                    ],
                    {**env, "SPENDGATE_ADMISSION_PORT": str(multi_port)},
                    tmp / "admission-multi.log",
                ):
                    c.wait_http(multi_port, "/readyz")
                    for n in budgets:
                        if n <= 5:
                            run(
                                f"spendgate x{args.workers} processes, {n} budget(s)",
                                "http",
                                "closed",
                                n,
                                multi_port,
                            )
                    run(
                        f"spendgate /v1/admit, 1 process, {budgets[0]} budget(s) (again)",
                        "http",
                        "closed",
                        budgets[0],
                        sg_port,
                    )
            if args.profile:
                n = 5 if 5 in budgets else budgets[0]
                for what, label, model in (
                    ("admitted", f"spendgate (profiled), {n} budget(s)", ""),
                    ("refused", "spendgate (profiled) refused, 1 budget", REFUSED_MODEL),
                ):
                    out = tmp / f"admission-profile-{what}.txt"
                    spy = _profile.start(server.pid, max(2.0, args.seconds - 1), out)
                    run(label, "http", "closed", 1 if model else n, sg_port, model)
                    if spy is not None:
                        spy.wait(timeout=60)
                    profile_lines += [f"{label}:", *_profile.summarize(out, top=15)]
        for count in scales:
            srid = f"{rid}s{count}"
            asyncio.run(_prepare(srid, [], count, _tenant_policies(count)))
            port = c.free_port()
            scale_env = {
                **env,
                "SPENDGATE_TOPIC_PREFIX": f"{srid}.",
                "SPENDGATE_REDIS_PREFIX": f"{srid}:",
                "SPENDGATE_ADMISSION_PORT": str(port),
            }
            try:
                with c.process(
                    [c.python(), "-m", "spendgate", "admission"],
                    scale_env,
                    tmp / f"admission-{count}.log",
                ):
                    c.wait_http(port, "/readyz")
                    spec = {
                        **base,
                        "tenants": count,
                        "prefix": f"{srid}:",
                        "label": f"spendgate {count:,} policies (1 per tenant)",
                        "target": "http",
                        "mode": "closed",
                        "budgets": 1,
                        "model": "ms",
                        "port": port,
                        "tag": f"{srid}-{uuid.uuid4().hex[:6]}",
                        "connections": args.concurrency,
                    }
                    results.append(_run_load(spec, tmp))
                    last = results[-1]
                    print(
                        f"  ran {spec['label']:34s} closed n={last['n']:>7,} "
                        f"{last['n'] / last['elapsed_s']:>9,.0f}/s statuses={last['statuses']}",
                        flush=True,
                    )
            finally:
                c.delete_redis_prefix(c.REDIS, f"{srid}:")
                c.delete_topics(c.KAFKA, f"{srid}.")
    finally:
        c.delete_redis_prefix(c.REDIS, f"{rid}:")
        c.delete_topics(c.KAFKA, f"{rid}.")
    _report(results, args, budgets, profile_lines)
    return c.exit_status(args.check)


def _report(
    results: list[dict[str, Any]], args: argparse.Namespace, budgets: list[int], prof: list[str]
) -> None:
    rows = []
    for r in results:
        s = c.summary_ms(r["latencies"])
        ok = sum(v for k, v in r["statuses"].items() if k == "200")
        rows.append(
            [
                r["label"],
                r["mode"] if r["mode"] == "closed" else f"open {args.rate:.0f}/s",
                r["n"],
                ok / r["elapsed_s"],
                r["n"] / r["elapsed_s"],
                r.get("server_us", "-"),
                r.get("redis_us", "-"),
                s["p50_ms"],
                s["p99_ms"],
                s["p999_ms"],
                s["max_ms"],
                ",".join(f"{k}:{v}" for k, v in sorted(r["statuses"].items())),
            ]
        )
    print()
    c.print_table(
        [
            "run",
            "load",
            "requests",
            "admits/s (200)",
            "answers/s",
            "server CPU us/req",
            "Redis script us/req",
            "p50 ms",
            "p99 ms",
            "p99.9 ms",
            "max ms",
            "statuses",
        ],
        rows,
    )

    def find(label_start: str, mode: str) -> list[dict[str, Any]]:
        return [r for r in results if r["label"].startswith(label_start) and r["mode"] == mode]

    def rate(r: dict[str, Any]) -> float:
        return float(r["n"] / r["elapsed_s"])

    def p99(r: dict[str, Any]) -> float:
        return float(c.summary_ms(r["latencies"])["p99_ms"])

    def first(label_start: str, mode: str) -> dict[str, Any] | None:
        found = find(label_start, mode)
        return found[0] if found else None

    empties = find("baseline empty endpoint", "closed")
    empty_rps = max(rate(r) for r in empties)
    bare = first("baseline bare asgi endpoint", "closed")
    empty_open = first("baseline empty endpoint", "open")
    bare_open = first("baseline bare asgi endpoint", "open")
    print()
    print("targets:")
    print(
        f"  (same run; empty endpoint: FastAPI empty route, best of {len(empties)} "
        f"runs {empty_rps:,.0f} req/s"
        + (f"; bare ASGI endpoint {rate(bare):,.0f} req/s" if bare else "")
        + "; same uvicorn options as spendgate)"
    )
    floors = {1: 0.5, 5: 0.3}
    one = first("spendgate /v1/admit, 1 ", "closed")
    for n in budgets:
        sg = first(f"spendgate /v1/admit, {n} ", "closed")
        if sg is None:
            continue
        share = rate(sg) / empty_rps
        line = f"  {n:>2} budget(s): closed loop {rate(sg):,.0f} admits/s = {100 * share:.0f}%"
        line += " of empty"
        if bare:
            line += f" ({100 * rate(sg) / rate(bare):.0f}% of bare ASGI)"
        if n in floors:
            ok = c.verdict(share >= floors[n], f"closed loop {n} budget(s)")
            line += f" (target >= {100 * floors[n]:.0f}%: {ok})"
        elif one is not None:
            rel = rate(sg) / rate(one)
            line += f"; {100 * rel:.0f}% of 1 budget (target >= 25%: "
            line += c.verdict(rel >= 0.25, f"{n} budgets vs 1") + ")"
        print(line)
        sg_open = first(f"spendgate /v1/admit, {n} ", "open")
        lua_open = first(f"baseline lua direct, {n} ", "open")
        if sg_open is not None and empty_open is not None:
            ok = c.verdict(p99(sg_open) <= 2 * p99(empty_open), f"open-loop p99 {n} budget(s)")
            print(
                f"  {n:>2} budget(s): open loop {args.rate:.0f}/s p99 {p99(sg_open):.2f} ms vs "
                f"empty endpoint p99 {p99(empty_open):.2f} ms (target <= 2x: {ok})"
                + (f"; bare ASGI p99 {p99(bare_open):.2f} ms" if bare_open else "")
                + (f"; lua direct p99 {p99(lua_open):.2f} ms" if lua_open else "")
            )
    refused = first("spendgate /v1/admit refused", "closed")
    if refused is not None:
        print(
            f"   1 budget, every request refused: {rate(refused):,.0f} answers/s = "
            f"{100 * rate(refused) / empty_rps:.0f}% of empty; server CPU "
            f"{refused.get('server_us', 0):,.0f} us/request, Redis "
            f"{refused.get('redis_us', 0):,.0f} us in scripts/request (reported; compared across "
            "versions in bench/RESULTS.md)"
        )
    for n in budgets:
        multi = first(f"spendgate x{args.workers} processes, {n} ", "closed")
        single = first(f"spendgate /v1/admit, {n} ", "closed")
        again = first("spendgate /v1/admit, 1 process", "closed")
        if multi is not None and single is not None:
            line = (
                f"  {n:>2} budget(s): {args.workers} processes {rate(multi):,.0f} admits/s vs "
                f"1 process {rate(single):,.0f}"
            )
            if again is not None and n == budgets[0]:
                line += f" (1 process again, same phase: {rate(again):,.0f})"
            print(line + " (server, Redis, Kafka and load generator share the machine's cores)")
    scaled = sorted(
        (r for r in results if r["label"].startswith("spendgate ") and "policies" in r["label"]),
        key=lambda r: int(r["label"].split()[1].replace(",", "")),
    )
    if len(scaled) >= 2:
        small, large = scaled[0], scaled[-1]
        rel = rate(large) / rate(small)
        print(
            f"  policies: {large['label']} {rate(large):,.0f} admits/s = {100 * rel:.0f}% of "
            f"{small['label']} {rate(small):,.0f} (target >= 90%: "
            f"{c.verdict(rel >= 0.9, 'policy scale')})"
        )
    if prof:
        print()
        print("profile of the admission server under closed-loop load (py-spy):")
        for line in prof:
            print("  " + line)
    if args.plots:
        plots = Path(args.plots)
        for mode, title in (
            ("open", f"admission latency, open loop {args.rate:.0f}/s (from intended send time)"),
            ("closed", f"admission latency, closed loop, {args.concurrency} connections"),
        ):
            path = c.plot_cdf(
                plots / f"admission-{mode}.png",
                title,
                [c.Series(f"{r['label']}", r["latencies"]) for r in results if r["mode"] == mode],
            )
            print(f"plot: {path.relative_to(c.ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
