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
background tasks ran meanwhile). A refused run sends requests that 1 (or 5, or 50)
``reject`` policies refuse every time (each key's window is already over its limit): the
plain reject path, with everything a refusal does (answer, Retry-After, refusal record).
Also: ``spendgate admission --workers 2`` against the one-process server, and a policy
scale run: one policy per tenant (exact ``match`` on ``tenant``), 10 against 10,000
policies, each on its own server and key prefix, requests spread over every tenant.

Windows (``--window``): the policies' window and bucket, 1 h of 1 min buckets by default;
also 1 m (1 s buckets), 24 h (1 min) and 31 d (1 h), or a comma list run one after the
other, each with its own run id, key prefix, policies, prefill and server. Every key is
prefilled dense: every bucket of the window non-empty (100 each; a 24 h key holds 1,440
buckets, so 500 tenants x 112 keys of a 24 h run take ~650 MB of Redis until that
window's runs end), written again before a run once 1% of its buckets have aged out. Per
window the report gives the Redis time each extra budget key costs ((us[5 budgets] -
us[1]) / 4, admitted and refused) and /v1/admit calls/s at 50 budgets over 1; at the end
a summary table, one row per window, and with 1 h and 24 h both run the 24 h / 1 h ratio
of Lua-direct calls/s (target >= 90%). With several windows the slow extras (open loop,
multi-process, policy scale, profile) are skipped and no plot is drawn, as with
``--quick``.

Run: ``.venv/bin/python -m bench.admission`` (``--smoke`` for the CI mode, ``--help``);
``--window 1m,1h,24h,31d`` for the window comparison.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _common as c
from bench import _profile

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


@dataclass(frozen=True)
class Window:
    """A window the benchmark runs: its policies' ``window`` and ``bucket``."""

    label: str
    window: str
    bucket: str
    window_ms: int
    bucket_ms: int

    @property
    def buckets(self) -> int:
        """Buckets in the window: how many the dense prefill writes per key."""
        return self.window_ms // self.bucket_ms

    @property
    def name(self) -> str:
        return f"{self.window} / {self.bucket}"


#: ``--window`` choices: 1 s buckets for 1 m, 1 min for 1 h and 24 h, 1 h for 31 d.
WINDOWS = {
    w.label: w
    for w in (
        Window("1m", "1m", "1s", 60_000, 1_000),
        Window("1h", "1h", "1m", 3_600_000, 60_000),
        Window("24h", "24h", "1m", 86_400_000, 60_000),
        Window("31d", "31d", "1h", 2_678_400_000, 3_600_000),
    )
}
DEFAULT_WINDOW = WINDOWS["1h"]
#: Every window key's expiry (the benchmark's keys never outlive it by much).
KEY_TTL_MS = 7_200_000


def _tenant_policies(count: int, window: Window = DEFAULT_WINDOW) -> list[Any]:
    from spendgate.schemas.policies import Policy

    return [
        Policy.model_validate(
            {
                "id": f"pt{i}",
                "match": {"tenant": f"t{i}"},
                "unit": "total_tokens",
                "limit": 10**12,
                "window": window.window,
                "bucket": window.bucket,
            }
        )
        for i in range(count)
    ]


#: The refused runs' model for 1 budget: one ``reject`` policy whose prefilled window
#: (every bucket 100) is already past its limit, so every request is refused.
REFUSED_MODEL = "mr"
#: The refused runs' limit: below any prefilled window's total (60 buckets of 100 at least).
REFUSED_LIMIT = 1_000


def refused_model(budgets: int) -> str:
    """The model ``budgets`` reject policies match, each already over its limit."""
    return REFUSED_MODEL if budgets == 1 else f"{REFUSED_MODEL}{budgets}"


def _refused_counts(budgets: list[int]) -> list[int]:
    """The refused runs' budget counts: 1 always, and each of ``budgets`` above 1."""
    return [1] + [n for n in budgets if n > 1]


def _policies(budgets: list[int], window: Window = DEFAULT_WINDOW) -> list[Any]:
    from spendgate.schemas.policies import Policy

    def policy(pid: str, model: str, limit: int) -> Any:
        return Policy.model_validate(
            {
                "id": pid,
                "match": {"model": model},
                "group_by": ["tenant"],
                "unit": "total_tokens",
                "limit": limit,
                "window": window.window,
                "bucket": window.bucket,
            }
        )

    return (
        [policy("refused-0", REFUSED_MODEL, REFUSED_LIMIT)]
        + [policy(f"b{n}-{i}", f"m{n}", 10**12) for n in budgets for i in range(n)]
        + [
            policy(f"refused{n}-{i}", refused_model(n), REFUSED_LIMIT)
            for n in _refused_counts(budgets)[1:]
            for i in range(n)
        ]
    )


def _models(budgets: list[int]) -> list[str]:
    return [f"m{n}" for n in budgets] + [refused_model(n) for n in _refused_counts(budgets)]


async def _fill(
    rid: str, policies: list[Any], models: list[str], tenants: int, window: Window
) -> int:
    """Write a dense window (every bucket of ``window`` 100, the newest the current one)
    on every key the models' requests of ``tenants`` tenants match; how many keys."""
    import redis.asyncio as aioredis

    from spendgate.schemas import window_codec
    from spendgate.schemas.events import Subject
    from spendgate.schemas.matching import PolicyIndex
    from spendgate.schemas.redis_keys import window_key

    now_ms = int(time.time() * 1000)
    head = now_ms - now_ms % window.bucket_ms
    value = window_codec.encode(
        {head - k * window.bucket_ms: 100 for k in range(window.buckets)}, window.bucket_ms
    )
    client = aioredis.Redis.from_url(c.REDIS)
    written = 0
    try:
        async with client.pipeline(transaction=False) as pipe:
            index = PolicyIndex(policies)
            for model in models:
                for t in range(tenants):
                    for target in index.targets(Subject(tenant=f"t{t}", model=model)):
                        pipe.set(window_key(f"{rid}:", target.key), value, px=KEY_TTL_MS)
                        written += 1
                        if written % 1000 == 0:  # a 24 h window is ~11 KB a key
                            await pipe.execute()
            await pipe.execute()
    finally:
        await client.aclose()
    return written


async def _prepare(
    rid: str,
    budgets: list[int],
    tenants: int,
    policies: list[Any] | None = None,
    window: Window = DEFAULT_WINDOW,
) -> int:
    """Topics, the policies in Redis, and a dense window (every bucket of ``window``
    non-empty) on every key used (``policies``: those instead of ``budgets``' policies,
    model ``ms``). How many keys were prefilled."""
    import redis.asyncio as aioredis

    from spendgate.streams.materialize import RedisMaterializer
    from spendgate.streams.settings import WorkerSettings
    from spendgate.streams.topics import ensure_topics

    await ensure_topics(
        WorkerSettings(kafka_bootstrap=c.KAFKA, topic_prefix=f"{rid}.", partitions=1)
    )
    models = _models(budgets)
    if policies is None:
        policies = _policies(budgets, window)
    else:
        models = ["ms"]
    client = aioredis.Redis.from_url(c.REDIS)
    try:
        await RedisMaterializer(client, f"{rid}:").stand_in(policies, c.STAND_IN, 2**52)
    finally:
        await client.aclose()
    return await _fill(rid, policies, models, tenants, window)


class _Prefill:
    """One window's run: its id, policies and when each model's keys were last filled.

    Before a run the keys of its model are filled again once more than 1% of the window's
    buckets (at least one) have aged out since they were written, so every run sees its
    windows dense (the 1 m window's 1 s buckets age out during a run; the others barely)."""

    def __init__(self, rid: str, window: Window, budgets: list[int], tenants: int) -> None:
        self.rid = rid
        self.window = window
        self.tenants = tenants
        self.policies = _policies(budgets, window)
        self.filled: dict[str, int] = {}

    def _head(self) -> int:
        now_ms = int(time.time() * 1000)
        return now_ms - now_ms % self.window.bucket_ms

    def filled_now(self, models: list[str]) -> None:
        head = self._head()
        self.filled.update(dict.fromkeys(models, head))

    def refresh(self, model: str) -> None:
        at = self.filled.get(model)
        if at is None:
            return
        aged = (self._head() - at) // self.window.bucket_ms
        if aged > self.window.buckets // 100:
            asyncio.run(_fill(self.rid, self.policies, [model], self.tenants, self.window))
            self.filled_now([model])


def _absorb(rid: str) -> None:
    """Forget the pending reservations and request records between runs, as the worker
    would absorb them; otherwise each run would scan the last run's pending entries."""
    for pattern in ("pw:", "pv:", "pq:", "pr:", "req:", "res:"):
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


#: What identifies a run in the summary: (``admit`` | ``lua``, ``admitted`` | ``refused``,
#: budgets).
Key = tuple[str, str, int]


def _windows(ap: argparse.ArgumentParser, text: str) -> list[Window]:
    labels = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in labels if x not in WINDOWS]
    if unknown or not labels:
        ap.error(f"--window: unknown {unknown or text!r}; choose from {', '.join(WINDOWS)}")
    if len(set(labels)) != len(labels):
        ap.error(f"--window: {text!r} names a window twice")
    return [WINDOWS[x] for x in labels]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.admission", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run")
    ap.add_argument("--rate", type=float, default=500.0, help="open-loop requests/s")
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop connections")
    ap.add_argument("--budgets", default="1,5,50", help="budgets matched per request")
    ap.add_argument("--tenants", type=int, default=500, help="distinct tenants (keys/policy)")
    ap.add_argument("--max-requests", type=int, default=200_000, help="cap per run")
    ap.add_argument(
        "--window",
        default=DEFAULT_WINDOW.label,
        help="the policies' window, or a comma list run one after the other, each with its "
        "own run id, key prefix, policies and server: "
        + ", ".join(f"{w.label} ({w.bucket} buckets)" for w in WINDOWS.values())
        + "; every key prefilled dense (every bucket of the window 100). More than one "
        "implies --quick (default: %(default)s)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="skip the slow extras: open-loop runs, the multi-process run, the policy scale "
        "run and --profile; no plots either (implied when --window lists more than one "
        "window)",
    )
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
    windows = _windows(ap, args.window)
    if args.prepare:
        # bench.admission_ab: each checkout prepares its own prefix with its own code.
        asyncio.run(_prepare(args.prepare, budgets, args.tenants, window=windows[0]))
        return 0
    if args.smoke:
        args.seconds, args.rate, args.tenants, args.max_requests = 0.5, 200.0, 20, 200
        budgets = [1]
        args.scale = ""
        args.plots = ""
    quick = args.quick or len(windows) > 1
    if quick:
        # The plots are the full run's (bench/plots): a quick run leaves them as they are.
        args.scale, args.profile, args.plots = "", False, ""
    rids = {w.label: c.run_id("adm") for w in windows}
    c.print_header(
        "admission benchmark",
        {
            "seconds_per_run": args.seconds,
            "open_loop_rate": args.rate,
            "closed_loop_connections": args.concurrency,
            "budgets": budgets,
            "refused_budgets": _refused_counts(budgets),
            "tenants": args.tenants,
            "windows": {
                w.label: {"window": w.window, "bucket": w.bucket, "run": rids[w.label]}
                for w in windows
            },
            "prefill": "every bucket of the window non-empty (100 each) on every key",
            "quick": quick,
        },
    )
    first_rid = rids[windows[0].label]
    tmp = Path(tempfile.mkdtemp(prefix=f"{first_rid}-"))
    empty_port, bare_port = c.free_port(), c.free_port()
    scales = [int(x) for x in args.scale.split(",") if x]
    results: list[dict[str, Any]] = []
    profile_lines: list[str] = []
    base = {
        "seconds": args.seconds,
        "max_requests": args.max_requests,
        "tenants": args.tenants,
        "redis_url": c.REDIS,
        "concurrency": args.concurrency,
        "rate": args.rate,
    }

    def run(
        label: str,
        target: str,
        mode: str,
        n: int,
        port: int = 0,
        model: str = "",
        prefill: _Prefill | None = None,
        server: int | None = None,
        key: Key | None = None,
    ) -> None:
        """One load run; ``server``: the pid of the spendgate server it loads, whose CPU
        time and Redis's script time per request are recorded (always for ``lua``)."""
        rid = prefill.rid if prefill is not None else first_rid
        spec = {
            **base,
            "prefix": f"{rid}:",
            "label": label,
            "target": target,
            "mode": mode,
            "budgets": n,
            "model": model or f"m{n}",
            "port": port,
            "tag": f"{rid}-{uuid.uuid4().hex[:6]}",
            "connections": args.concurrency if mode == "closed" else 64,
        }
        if prefill is not None and (server is not None or target == "lua"):
            prefill.refresh(spec["model"])
        cpu0 = _cpu_s(server) if server is not None else None
        usec0 = _script_usec()
        results.append(_run_load(spec, tmp))
        usec1 = _script_usec()
        last = results[-1]
        last["window"] = prefill.window.label if prefill is not None else ""
        last["key"] = key
        if server is not None and cpu0 is not None:
            last["server_us"] = 1e6 * (_cpu_s(server) - cpu0) / last["sent"]
        if server is not None or target == "lua":
            last["redis_us"] = (usec1 - usec0) / last["sent"]
        if prefill is not None:
            _absorb(prefill.rid)
        print(
            f"  ran {label:34s} {mode:6s} n={last['n']:>7,} "
            f"{last['n'] / last['elapsed_s']:>9,.0f}/s statuses={last['statuses']}",
            flush=True,
        )

    try:
        with (
            c.process(
                [c.python(), "-m", "bench._empty_app", str(empty_port)], {}, tmp / "empty.log"
            ) as empty,
            c.process(
                [c.python(), "-m", "bench._empty_app", str(bare_port), "asgi"],
                {},
                tmp / "bare.log",
            ) as bare,
        ):
            c.wait_http(empty_port, "/healthz")
            c.wait_http(bare_port, "/healthz")
            run("baseline empty endpoint", "http", "closed", 1, empty_port, server=empty.pid)
            run("baseline bare asgi endpoint", "http", "closed", 1, bare_port, server=bare.pid)
            for window in windows:
                rid = rids[window.label]
                started = time.perf_counter()
                prefill = _Prefill(rid, window, budgets, args.tenants)
                keys = asyncio.run(_prepare(rid, budgets, args.tenants, window=window))
                prefill.filled_now(_models(budgets))
                print(
                    f"window {window.name} (run {rid}): {keys:,} keys prefilled with "
                    f"{window.buckets:,} buckets each in {time.perf_counter() - started:.1f} s",
                    flush=True,
                )
                try:
                    _window_runs(
                        run,
                        args,
                        (empty_port, bare_port, empty.pid),
                        budgets,
                        window,
                        prefill,
                        quick,
                        tmp,
                        profile_lines,
                    )
                finally:
                    c.delete_redis_prefix(c.REDIS, f"{rid}:")
                    c.delete_topics(c.KAFKA, f"{rid}.")
        for count in scales:
            srid = f"{first_rid}s{count}"
            asyncio.run(_prepare(srid, [], count, _tenant_policies(count, windows[0]), windows[0]))
            port = c.free_port()
            scale_env = _server_env(srid, port)
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
                    last["window"], last["key"] = windows[0].label, None
                    print(
                        f"  ran {spec['label']:34s} closed n={last['n']:>7,} "
                        f"{last['n'] / last['elapsed_s']:>9,.0f}/s statuses={last['statuses']}",
                        flush=True,
                    )
            finally:
                c.delete_redis_prefix(c.REDIS, f"{srid}:")
                c.delete_topics(c.KAFKA, f"{srid}.")
    finally:
        for rid in rids.values():
            c.delete_redis_prefix(c.REDIS, f"{rid}:")
            c.delete_topics(c.KAFKA, f"{rid}.")
    _report(results, args, budgets, windows, profile_lines)
    return c.exit_status(args.check)


def _server_env(rid: str, port: int) -> dict[str, str]:
    return {
        "SPENDGATE_KAFKA_BOOTSTRAP": c.KAFKA,
        "SPENDGATE_REDIS_URL": c.REDIS,
        "SPENDGATE_TOPIC_PREFIX": f"{rid}.",
        "SPENDGATE_REDIS_PREFIX": f"{rid}:",
        "SPENDGATE_ADMISSION_PORT": str(port),
    }


def _window_runs(
    run: Callable[..., None],
    args: argparse.Namespace,
    ports: tuple[int, int, int],
    budgets: list[int],
    window: Window,
    prefill: _Prefill,
    quick: bool,
    tmp: Path,
    profile_lines: list[str],
) -> None:
    """One window's runs against its own server (and, unless quick, the slow extras)."""
    sg_port, multi_port = c.free_port(), c.free_port()
    env = _server_env(prefill.rid, sg_port)
    empty_port, bare_port, empty_pid = ports
    with c.process(
        [c.python(), "-m", "spendgate", "admission"], env, tmp / f"admission-{window.label}.log"
    ) as server:
        c.wait_http(sg_port, "/readyz")
        sg = {"port": sg_port, "prefill": prefill, "server": server.pid}
        lua = {"prefill": prefill}
        for n in budgets:
            key = ("admit", "admitted", n)
            run(f"spendgate /v1/admit, {n} budget(s)", "http", "closed", n, **sg, key=key)
            key = ("lua", "admitted", n)
            run(f"baseline lua direct, {n} budget(s)", "lua", "closed", n, **lua, key=key)
        for n in _refused_counts(budgets):
            what = "refused, 1 budget" if n == 1 else f"refused, {n} budgets"
            model = refused_model(n)
            key = ("admit", "refused", n)
            run(f"spendgate /v1/admit {what}", "http", "closed", n, model=model, **sg, key=key)
            key = ("lua", "refused", n)
            run(f"baseline lua direct {what}", "lua", "closed", n, model=model, **lua, key=key)
        run("baseline empty endpoint (again)", "http", "closed", 1, empty_port, server=empty_pid)
        if quick:
            return
        run("baseline empty endpoint", "http", "open", 1, empty_port)
        run("baseline bare asgi endpoint", "http", "open", 1, bare_port)
        for n in budgets:
            if n > 5:
                continue
            run(f"spendgate /v1/admit, {n} budget(s)", "http", "open", n, **sg)
            run(f"baseline lua direct, {n} budget(s)", "lua", "open", n, **lua)
        if args.workers > 1:
            with c.process(
                [c.python(), "-m", "spendgate", "admission", "--workers", str(args.workers)],
                {**env, "SPENDGATE_ADMISSION_PORT": str(multi_port)},
                tmp / f"admission-multi-{window.label}.log",
            ):
                c.wait_http(multi_port, "/readyz")
                for n in budgets:
                    if n <= 5:
                        label = f"spendgate x{args.workers} processes, {n} budget(s)"
                        run(label, "http", "closed", n, multi_port, prefill=prefill)
                label = f"spendgate /v1/admit, 1 process, {budgets[0]} budget(s) (again)"
                run(label, "http", "closed", budgets[0], **sg)
        if args.profile:
            n = 5 if 5 in budgets else budgets[0]
            for what, label, model in (
                ("admitted", f"spendgate (profiled), {n} budget(s)", ""),
                ("refused", "spendgate (profiled) refused, 1 budget", REFUSED_MODEL),
            ):
                out = tmp / f"admission-profile-{what}.txt"
                spy = _profile.start(server.pid, max(2.0, args.seconds - 1), out)
                run(label, "http", "closed", 1 if model else n, model=model, **sg)
                if spy is not None:
                    spy.wait(timeout=60)
                profile_lines += [f"{label}:", *_profile.summarize(out, top=15)]


def _rate(r: dict[str, Any]) -> float:
    return float(r["n"] / r["elapsed_s"])


def _p99(r: dict[str, Any]) -> float:
    return float(c.summary_ms(r["latencies"])["p99_ms"])


def _report(
    results: list[dict[str, Any]],
    args: argparse.Namespace,
    budgets: list[int],
    windows: list[Window],
    prof: list[str],
) -> None:
    rows = []
    for r in results:
        s = c.summary_ms(r["latencies"])
        ok = sum(v for k, v in r["statuses"].items() if k == "200")
        rows.append(
            [
                r["label"],
                r["window"] or "-",
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
            "window",
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

    def first(label_start: str, mode: str, window: str | None = None) -> dict[str, Any] | None:
        found = [
            r
            for r in results
            if r["label"].startswith(label_start)
            and r["mode"] == mode
            and (window is None or r["window"] == window)
        ]
        return found[0] if found else None

    empties = [
        r
        for r in results
        if r["label"].startswith("baseline empty endpoint") and r["mode"] == "closed"
    ]
    empty_rps = max(_rate(r) for r in empties)
    # The empty endpoint's CPU per request, at its best in this run (as its rate).
    empty_us = min((r["server_us"] for r in empties if "server_us" in r), default=0.0)
    bare = first("baseline bare asgi endpoint", "closed")
    empty_open = first("baseline empty endpoint", "open")
    bare_open = first("baseline bare asgi endpoint", "open")
    several = len(windows) > 1
    print()
    print("targets:")
    print(
        f"  (same run; empty endpoint: FastAPI empty route, best of {len(empties)} "
        f"runs {empty_rps:,.0f} req/s, server CPU {empty_us:,.0f} us/req"
        + (f"; bare ASGI endpoint {_rate(bare):,.0f} req/s" if bare else "")
        + "; same uvicorn options as spendgate)"
    )
    floors = {1: 0.5, 5: 0.3}
    for window in windows:
        w = window.label
        tag = f" [{w}]" if several else ""
        if several:
            print(f"  window {window.name}:")
        one = first("spendgate /v1/admit, 1 ", "closed", w)
        for n in budgets:
            sg = first(f"spendgate /v1/admit, {n} ", "closed", w)
            if sg is None:
                continue
            share = _rate(sg) / empty_rps
            line = f"  {n:>2} budget(s): closed loop {_rate(sg):,.0f} admits/s = {100 * share:.0f}%"
            line += " of empty"
            if bare:
                line += f" ({100 * _rate(sg) / _rate(bare):.0f}% of bare ASGI)"
            if n in floors:
                ok = c.verdict(share >= floors[n], f"closed loop {n} budget(s){tag}")
                line += f" (target >= {100 * floors[n]:.0f}%: {ok})"
            elif one is not None:
                rel = _rate(sg) / _rate(one)
                line += f"; {100 * rel:.0f}% of 1 budget (target >= 25%: "
                line += c.verdict(rel >= 0.25, f"{n} budgets vs 1{tag}") + ")"
            print(line)
            if n == 1 and "server_us" in sg and empty_us:
                rel = sg["server_us"] / empty_us
                ok = c.verdict(rel <= 2, f"server CPU per admit, 1 budget{tag}")
                print(
                    f"   1 budget(s): server CPU {sg['server_us']:,.0f} us/admitted request = "
                    f"{rel:.2f}x the empty endpoint's {empty_us:,.0f} us (target <= 2x: {ok})"
                )
            sg_open = first(f"spendgate /v1/admit, {n} ", "open", w)
            lua_open = first(f"baseline lua direct, {n} ", "open", w)
            if sg_open is not None and empty_open is not None:
                ok = c.verdict(
                    _p99(sg_open) <= 2 * _p99(empty_open), f"open-loop p99 {n} budget(s){tag}"
                )
                print(
                    f"  {n:>2} budget(s): open loop {args.rate:.0f}/s p99 {_p99(sg_open):.2f} ms "
                    f"vs empty endpoint p99 {_p99(empty_open):.2f} ms (target <= 2x: {ok})"
                    + (f"; bare ASGI p99 {_p99(bare_open):.2f} ms" if bare_open else "")
                    + (f"; lua direct p99 {_p99(lua_open):.2f} ms" if lua_open else "")
                )
        for n in _refused_counts(budgets):
            what = "1 budget" if n == 1 else f"{n} budgets"
            refused = first(f"spendgate /v1/admit refused, {n} ", "closed", w)
            if refused is not None:
                print(
                    f"  {what:>9}, every request refused: {_rate(refused):,.0f} answers/s = "
                    f"{100 * _rate(refused) / empty_rps:.0f}% of empty; server CPU "
                    f"{refused.get('server_us', 0):,.0f} us/request, Redis "
                    f"{refused.get('redis_us', 0):,.0f} us in scripts/request (reported; "
                    "compared across versions in bench/RESULTS.md)"
                )
        for n in budgets:
            multi = first(f"spendgate x{args.workers} processes, {n} ", "closed", w)
            single = first(f"spendgate /v1/admit, {n} ", "closed", w)
            again = first("spendgate /v1/admit, 1 process", "closed", w)
            if multi is not None and single is not None:
                line = (
                    f"  {n:>2} budget(s): {args.workers} processes {_rate(multi):,.0f} admits/s "
                    f"vs 1 process {_rate(single):,.0f}"
                )
                if again is not None and n == budgets[0]:
                    line += f" (1 process again, same phase: {_rate(again):,.0f})"
                print(line + " (server, Redis, Kafka and load generator share the machine's cores)")
        figures = _figures(results, w)
        if figures["lua_slope_admitted"] == figures["lua_slope_admitted"]:  # not NaN
            print(
                "  Redis us/call per budget key, 1 -> 5 budgets ((us[5] - us[1]) / 4): "
                f"lua direct admitted {figures['lua_slope_admitted']:.1f}, refused "
                f"{figures['lua_slope_refused']:.1f}; /v1/admit admitted "
                f"{figures['admit_slope_admitted']:.1f}, refused "
                f"{figures['admit_slope_refused']:.1f}"
            )
        if figures["admit_50_over_1"] == figures["admit_50_over_1"]:
            print(f"  /v1/admit calls/s, 50 budgets / 1 budget: {figures['admit_50_over_1']:.2f}")
    scaled = sorted(
        (r for r in results if r["label"].startswith("spendgate ") and "policies" in r["label"]),
        key=lambda r: int(r["label"].split()[1].replace(",", "")),
    )
    if len(scaled) >= 2:
        small, large = scaled[0], scaled[-1]
        rel = _rate(large) / _rate(small)
        print(
            f"  policies: {large['label']} {_rate(large):,.0f} admits/s = {100 * rel:.0f}% of "
            f"{small['label']} {_rate(small):,.0f} (target >= 90%: "
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
                [
                    c.Series(
                        r["label"] + (f" [{r['window']}]" if several and r["window"] else ""),
                        r["latencies"],
                    )
                    for r in results
                    if r["mode"] == mode
                ],
            )
            print(f"plot: {path.relative_to(c.ROOT)}")
    _summary(results, windows)


NAN = float("nan")


def _figures(results: list[dict[str, Any]], window: str) -> dict[str, float]:
    """One window's summary figures (NaN where a run is missing): closed-loop calls/s
    (answers/s) and Redis script us per call of each Lua-direct and /v1/admit run, keyed
    ``<admit|lua>_<admitted|refused>_<budgets>[_us]``; the per-key slopes
    ``<admit|lua>_slope_<phase>`` = (us[5 budgets] - us[1]) / 4; ``admit_50_over_1``."""
    out: dict[str, float] = {}
    for r in results:
        if r["window"] == window and r.get("key") is not None:
            kind, phase, n = r["key"]
            name = f"{kind}_{phase}_{n}"
            out.setdefault(name, _rate(r))
            out.setdefault(f"{name}_us", float(r.get("redis_us", NAN)))
    for kind in ("lua", "admit"):
        for phase in ("admitted", "refused"):
            one = out.get(f"{kind}_{phase}_1_us", NAN)
            five = out.get(f"{kind}_{phase}_5_us", NAN)
            out[f"{kind}_slope_{phase}"] = (five - one) / 4
    out["admit_50_over_1"] = out.get("admit_admitted_50", NAN) / out.get("admit_admitted_1", NAN)
    return out


def _summary(results: list[dict[str, Any]], windows: list[Window]) -> None:
    """One row per window; then, with 1 h and 24 h both run, 24 h over 1 h."""
    figures = {w.label: _figures(results, w.label) for w in windows}
    columns = [
        ("lua 1 /s", "lua_admitted_1"),
        ("lua 5 /s", "lua_admitted_5"),
        ("lua 50 /s", "lua_admitted_50"),
        ("lua refused 1 /s", "lua_refused_1"),
        ("lua refused 5 /s", "lua_refused_5"),
        ("lua 1 Redis us", "lua_admitted_1_us"),
        ("lua 5 Redis us", "lua_admitted_5_us"),
        ("lua 50 Redis us", "lua_admitted_50_us"),
        ("lua refused 1 Redis us", "lua_refused_1_us"),
        ("lua refused 5 Redis us", "lua_refused_5_us"),
        ("slope us/key admitted", "lua_slope_admitted"),
        ("slope us/key refused", "lua_slope_refused"),
        ("admit 1 /s", "admit_admitted_1"),
        ("admit 5 /s", "admit_admitted_5"),
        ("admit 50 /s", "admit_admitted_50"),
        ("admit 50/1", "admit_50_over_1"),
    ]
    print()
    print(
        "summary by window (closed loop; lua = Lua direct, admit = /v1/admit; /s = calls/s; "
        "Redis us = script time per call; slope = (us[5 budgets] - us[1]) / 4, Lua direct):"
    )
    c.print_table(
        ["window", *(title for title, _ in columns)],
        [[w.name, *(figures[w.label].get(name, NAN) for _, name in columns)] for w in windows],
    )
    if "1h" in figures and "24h" in figures:
        long, short = figures["24h"], figures["1h"]
        print("24h / 1h, Lua direct calls/s (target >= 90%):")
        for phase in ("admitted", "refused"):
            for n in (1, 5):
                name = f"lua_{phase}_{n}"
                ratio = long.get(name, NAN) / short.get(name, NAN)
                if ratio != ratio:
                    continue
                ok = c.verdict(ratio >= 0.9, f"24h/1h lua direct {n} budget(s) {phase}")
                print(
                    f"  {n} budget(s) {phase:8}: 24h {long[name]:,.0f}/s vs 1h "
                    f"{short[name]:,.0f}/s = {100 * ratio:.0f}% ({ok})"
                )


if __name__ == "__main__":
    sys.exit(main())
