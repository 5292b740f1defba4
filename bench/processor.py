"""Processor benchmark: events/s of a real ``spendgate worker`` and event freshness.

1. Throughput. A topic of N commit events over K budget keys (one policy grouping by
   tenant) is produced first; then, in the same run, a plain aiokafka consumer reads it
   (baselines: raw consume, and raw consume + ``json.loads``), a faust app whose one agent
   only takes batches (``noack_take``) and acks them reads it (baseline: the floor of any
   faust worker), and a ``spendgate worker`` child processes it. The worker's rate is
   measured from its own ``/metrics``: ``spendgate_keyed_records_total`` (records applied
   to the table and mirrored to Redis) from its first processed event to the N-th.
   In-process, without I/O: the same records through ``streams.fold.fold_usage`` in
   batches (the fold alone), the decode of one record (msgspec fast path against
   ``parse_event``) and the policy lookup (``PolicyIndex`` against a scan, 10,000 policies).
2. Freshness at a steady rate: a separate process produces background events at R/s while
   this process sends one probe event every 100 ms and polls Redis until the probe's key
   shows it (event produced -> visible to admission). Baseline in the same run: a plain
   aiokafka consumer timing the same probes (produced -> consumable, the broker's floor).

Run: ``.venv/bin/python -m bench.processor`` (``--smoke`` for the CI mode, ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import _common as c
from bench import _kafka as k
from bench import _profile


def _noop_faust(s: Any, tmp: Path, events: int, batch: int) -> dict[str, Any]:
    """Run the no-op faust batch agent on the usage topic until it saw ``events``."""
    spec = {
        "app_id": f"{s.app_id}-noop",
        "bootstrap": s.kafka_bootstrap,
        "topic": s.topic("usage"),
        "partitions": s.partitions,
        "data_dir": str(tmp / "noop"),
        "batch": batch,
        "within_s": 0.05,
        "events": events,
        "out": str(tmp / "noop.json"),
    }
    (tmp / "noop-spec.json").write_text(json.dumps(spec))
    out = Path(spec["out"])
    with c.process(
        [c.python(), "-m", "bench._noop_faust", str(tmp / "noop-spec.json")], {}, tmp / "noop.log"
    ) as child:
        deadline = time.monotonic() + max(300.0, events / 500)
        while not out.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.1)  # the child writes the file in one call; let it land
    if not out.exists():
        print(f"  no-op faust agent wrote no result; log: {tmp / 'noop.log'}", flush=True)
        return {"ok": False}
    return {"ok": True, **json.loads(out.read_text())}


def _noop_rate(noop: dict[str, Any]) -> float:
    """The no-op agent's records/s; NaN when it timed nothing (all in its first batch)."""
    if not noop["ok"] or noop["n"] <= 0 or noop["seconds"] <= 0:
        return float("nan")
    return float(noop["n"] / noop["seconds"])


def _records(events: int, keys: int, partitions: int) -> list[Any]:
    """The topic's workload as in-memory usage records (tenant -> partition by hash)."""
    import random
    import zlib

    from spendgate.streams.fold import UsageRecord

    rng = random.Random(1)
    now = int(time.time() * 1000)
    start = now - 30 * 60_000
    out = []
    for i in range(events):
        tenant = f"t{i % keys}" if i < keys else f"t{rng.randrange(keys)}"
        value = k.event(tenant, start + (30 * 60_000) * i // events, rng.randint(10, 2000))
        out.append(UsageRecord(zlib.crc32(tenant.encode()) % partitions, i, now, value))
    return out


def _fold_only(records: list[Any], batch: int) -> float:
    """Events/s of ``fold_usage`` over ``records`` in batches, tables in a dict, no I/O."""
    from spendgate.schemas.policies import Policy
    from spendgate.streams.dedupe import IdStore
    from spendgate.streams.fold import Rules, fold_usage
    from spendgate.streams.ledger import KeyState

    rules = Rules([Policy.model_validate(k.POLICY)], None)
    table: dict[str, bytes] = {}

    def load(key: str) -> KeyState:
        return KeyState.from_bytes(table.get(key))

    ids = IdStore(None, 86_400_000)
    try:
        t0 = time.perf_counter()
        for first in range(0, len(records), batch):
            result = fold_usage(
                records[first : first + batch],
                load,
                rules,
                max_future_skew_ms=300_000,
                max_value_bytes=900_000,
                ids=ids,
            )
            for write in result.writes:
                table[write.key] = write.table_value()
                write.window()
        return len(records) / (time.perf_counter() - t0)
    finally:
        ids.close()


def _per_event_us(fn: Any, values: list[Any]) -> float:
    t0 = time.perf_counter()
    for value in values:
        fn(value)
    return (time.perf_counter() - t0) / len(values) * 1e6


def _lean_figures(records: list[Any]) -> list[list[object]]:
    """Decode and policy lookup, per event, fast against today's."""
    from spendgate.schemas.events import Subject, parse_event
    from spendgate.schemas.fastdecode import decode
    from spendgate.schemas.matching import PolicyIndex, targets
    from spendgate.schemas.policies import Policy

    values = [r.value for r in records[:20_000]]
    fast = _per_event_us(decode, values)
    slow = _per_event_us(parse_event, values)
    policies = [
        Policy.model_validate({**k.POLICY, "id": f"p{i}", "match": {"tenant": f"t{i}"}})
        for i in range(10_000)
    ]
    index = PolicyIndex(policies)
    subjects = [Subject(tenant=f"t{i * 7 % 10_000}", model="m") for i in range(2_000)]
    scan = _per_event_us(lambda s: targets(policies, s), subjects[:200])
    indexed = _per_event_us(index.targets, subjects)
    return [
        ["decode: parse_event (pydantic)", slow, "100%"],
        ["decode: schemas.fastdecode.decode (msgspec)", fast, f"{100 * fast / slow:.0f}%"],
        ["policy lookup: targets() scan, 10,000 policies", scan, "100%"],
        [
            "policy lookup: PolicyIndex.targets, 10,000 policies",
            indexed,
            f"{100 * indexed / scan:.2f}%",
        ],
    ]


def _metric(port: int, name: str) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _throughput(
    port: int, events: int, timeout_s: float, worker: Any, profile: Path | None
) -> dict[str, Any]:
    """Poll the worker's metrics until it applied ``events`` keyed records (or it exits)."""
    pid = worker.pid
    t_start = time.perf_counter()
    first = None
    series: list[tuple[float, float]] = []
    spy = None
    deadline = t_start + timeout_s
    done = None
    idle = t_start  # the last poll that saw nothing applied yet
    while time.perf_counter() < deadline and worker.poll() is None:
        applied = _metric(port, "spendgate_keyed_records_total")
        now = time.perf_counter()
        if applied <= 0:
            idle = now
        if applied > 0 and first is None:
            # A batch can apply many records between two polls: count from the last
            # poll that saw none, so the first batch is timed too (a lower bound).
            first = (idle, 0.0)
            if profile is not None:
                spy = _profile.start(pid, 20, profile)
        if applied >= 0:
            series.append((now - t_start, applied))
        if applied >= events:
            done = now
            break
        time.sleep(0.2)
    if spy is not None:
        spy.wait(timeout=60)
    if first is None or done is None:
        return {"ok": False, "series": series}
    return {
        "ok": True,
        "rate": (events - first[1]) / (done - first[0]),
        "startup_s": first[0] - t_start,
        "total_s": done - t_start,
        "series": series,
    }


async def _background(s: Any, rate: float, seconds: float, keys: int) -> int:
    """Produce ``rate`` events/s for ``seconds`` (paced every 10 ms); return events sent."""
    from aiokafka import AIOKafkaProducer

    sent = 0
    async with AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, linger_ms=5) as producer:
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            due = int(elapsed * rate)
            now_ms = int(time.time() * 1000)
            while sent < due:
                tenant = f"t{sent % keys}"
                await producer.send(
                    s.topic("usage"), k.event(tenant, now_ms, 100), key=tenant.encode()
                )
                sent += 1
            await asyncio.sleep(0.01)
        await producer.flush()
    return sent


async def _freshness(s: Any, probes: int, seconds: float) -> dict[str, Any]:
    """Probe events on their own key: produced -> in Redis, and produced -> consumable."""
    import redis.asyncio as aioredis
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from spendgate.schemas import window_codec
    from spendgate.schemas.redis_keys import window_key
    from spendgate.streams.kafka_util import partitions, stop

    client = aioredis.Redis.from_url(s.redis_url)
    wkey = window_key(s.redis_prefix, "pb|tenant=probe")
    sent_at: dict[str, float] = {}
    kafka_lat: list[float] = []
    redis_lat: list[float] = []
    consumer = AIOKafkaConsumer(
        bootstrap_servers=s.kafka_bootstrap, enable_auto_commit=False, fetch_max_wait_ms=5
    )
    await consumer.start()
    tps = await partitions(consumer, s.topic("usage"))
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)
    stop_flag = asyncio.Event()

    async def watch_kafka() -> None:
        while not stop_flag.is_set():
            batch = await consumer.getmany(timeout_ms=50)
            now = time.perf_counter()
            for messages in batch.values():
                for m in messages:
                    if m.key == b"probe":
                        eid = json.loads(m.value or b"{}")["event_id"]
                        if eid in sent_at:
                            kafka_lat.append(now - sent_at[eid])

    async def total() -> int:
        raw = await client.get(wkey)
        return sum(window_codec.decode(raw).buckets.values()) if raw else 0

    watcher = asyncio.create_task(watch_kafka())
    lost = 0
    async with AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, linger_ms=0) as producer:
        before = await total()
        start = time.perf_counter()
        for _ in range(probes):
            if time.perf_counter() - start > seconds:
                break
            raw = k.event("probe", int(time.time() * 1000), 1)
            eid = json.loads(raw)["event_id"]
            t0 = time.perf_counter()
            sent_at[eid] = t0
            await producer.send(s.topic("usage"), raw, key=b"probe")
            deadline = t0 + 5.0
            while time.perf_counter() < deadline:
                now_total = await total()
                if now_total > before:
                    redis_lat.append(time.perf_counter() - t0)
                    before = now_total
                    break
                await asyncio.sleep(0.001)
            else:
                lost += 1
            await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - t0)))
    await asyncio.sleep(0.3)
    stop_flag.set()
    await watcher
    await stop(consumer)
    await client.aclose()
    return {"redis": redis_lat, "kafka": kafka_lat, "timeouts": lost}


def _bg_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    s = k.settings(spec["rid"], Path(spec["data_dir"]))
    sent = asyncio.run(_background(s, spec["rate"], spec["seconds"], spec["keys"]))
    Path(spec["out"]).write_text(json.dumps({"sent": sent}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.processor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000, help="N events in the topic")
    ap.add_argument("--keys", type=int, default=10_000, help="K budget keys")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="freshness background events/s (0: half the measured worker rate, at most 5,000)",
    )
    ap.add_argument("--freshness-seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=1000, help="batch bound (fold, no-op agent)")
    ap.add_argument(
        "--fold-events",
        type=int,
        default=200_000,
        help="at most this many records through the in-process fold (it is timed alone)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny CI run (a few hundred events)")
    ap.add_argument("--profile", action="store_true", help="py-spy the worker (20 s)")
    ap.add_argument("--plots", default=str(c.PLOTS), help="where PNGs go ('' for none)")
    ap.add_argument("--background", help=argparse.SUPPRESS)
    c.add_check_flag(ap)
    args = ap.parse_args(argv)
    if args.background:
        _bg_main(args.background)
        return 0
    if args.smoke:
        args.events, args.keys, args.freshness_seconds, args.plots = 300, 50, 2.0, ""
        args.rate = args.rate or 50.0
    rid = c.run_id("proc")
    tmp = Path(tempfile.mkdtemp(prefix=f"{rid}-"))
    port = c.free_port()
    s = k.settings(rid, tmp / "tables", metrics_port=port, partitions=args.partitions)
    c.print_header(
        "processor benchmark",
        {
            "events": args.events,
            "keys": args.keys,
            "partitions": args.partitions,
            "policy": k.POLICY,
            "run": rid,
        },
    )
    lines: list[str] = []
    prof_lines: list[str] = []
    try:
        asyncio.run(k.setup_topics(s))
        produce_s = asyncio.run(k.fill(s, args.events, args.keys))
        print(f"  produced {args.events:,} events in {produce_s:.1f} s", flush=True)
        n_raw, raw_s = asyncio.run(k.raw_consume(s))
        n_parse, parse_s = asyncio.run(k.raw_consume(s, parse=True))
        print(f"  raw consume: {n_raw:,} in {raw_s:.2f} s", flush=True)
        noop = _noop_faust(s, tmp, args.events, args.batch)
        print(f"  no-op faust batch agent: {noop}", flush=True)
        records = _records(min(args.events, args.fold_events), args.keys, args.partitions)
        fold_rate = _fold_only(records, args.batch)
        lean = _lean_figures(records)
        print(f"  fold only: {fold_rate:,.0f} events/s", flush=True)
        profile = tmp / "worker-profile.txt" if args.profile else None
        with c.process(
            [c.python(), "-m", "spendgate", "worker"], k.worker_env(s), tmp / "worker.log"
        ) as worker:
            tp = _throughput(port, args.events, max(300.0, args.events / 100), worker, profile)
            if not tp["ok"]:
                exited = worker.poll()
                why = "did not finish" if exited is None else f"exited with {exited}"
                print(f"worker {why}; log: {tmp / 'worker.log'}")
                return 1
            import redis

            r = redis.Redis.from_url(c.REDIS)
            windows = sum(1 for _ in r.scan_iter(match=f"{rid}:w:*", count=5000))
            r.close()
            print(
                f"  worker: {args.events:,} in {args.events / tp['rate']:.1f} s after "
                f"{tp['startup_s']:.1f} s startup; {windows:,} windows in Redis",
                flush=True,
            )
            rate = args.rate or min(5000.0, round(tp["rate"] / 2, -1))
            spec = {
                "rid": rid,
                "data_dir": str(tmp / "tables"),
                "rate": rate,
                "seconds": args.freshness_seconds + 3,
                "keys": args.keys,
                "out": str(tmp / "bg.json"),
            }
            (tmp / "bg-spec.json").write_text(json.dumps(spec))
            with c.process(
                [c.python(), "-m", "bench.processor", "--background", str(tmp / "bg-spec.json")],
                {},
                tmp / "bg.log",
            ) as bg:
                time.sleep(2.0)  # let the background rate settle
                fresh = asyncio.run(
                    _freshness(s, int(args.freshness_seconds * 10) + 1, args.freshness_seconds)
                )
                bg.wait(timeout=args.freshness_seconds + 60)
            bg_sent = (
                json.loads((tmp / "bg.json").read_text())["sent"]
                if (tmp / "bg.json").exists()
                else 0
            )
            if profile is not None:
                prof_lines = _profile.summarize(profile, top=15)
                if profile.exists():
                    kept = Path(tempfile.gettempdir()) / "spendgate-worker-profile.txt"
                    shutil.copyfile(profile, kept)
                    prof_lines.append(f"raw stacks (py-spy collapsed) kept at {kept}")
    finally:
        c.delete_redis_prefix(c.REDIS, f"{rid}:")
        c.delete_topics(c.KAFKA, rid)
    raw_rate = n_raw / raw_s
    parse_rate = n_parse / parse_s
    noop_rate = _noop_rate(noop)
    print()
    c.print_table(
        ["throughput", "records", "seconds", "records/s", "vs raw"],
        [
            ["baseline: raw aiokafka consume", n_raw, raw_s, raw_rate, "100%"],
            [
                "baseline: raw consume + json.loads",
                n_parse,
                parse_s,
                parse_rate,
                f"{100 * parse_rate / raw_rate:.0f}%",
            ],
            [
                "baseline: no-op faust batch agent (noack_take + ack)",
                noop.get("n", 0),
                noop.get("seconds", float("nan")),
                noop_rate,
                f"{100 * noop_rate / raw_rate:.0f}%",
            ],
            [
                "spendgate fold only (streams.fold, in-process, no I/O)",
                len(records),
                len(records) / fold_rate,
                fold_rate,
                f"{100 * fold_rate / raw_rate:.0f}%",
            ],
            [
                "spendgate worker (split + account + Redis)",
                args.events,
                args.events / tp["rate"],
                tp["rate"],
                f"{100 * tp['rate'] / raw_rate:.1f}%",
            ],
        ],
    )
    print()
    c.print_table(["per event, in-process", "us/event", "vs today"], lean)
    fr, fk = c.summary_ms(fresh["redis"]), c.summary_ms(fresh["kafka"])
    print()
    c.print_table(
        ["freshness at background rate", "probes", "p50 ms", "p99 ms", "max ms", "timeouts (>5 s)"],
        [
            [
                f"baseline: produced -> consumable (raw), {rate:.0f}/s",
                len(fresh["kafka"]),
                fk["p50_ms"],
                fk["p99_ms"],
                fk["max_ms"],
                "-",
            ],
            [
                f"spendgate: produced -> visible in Redis, {rate:.0f}/s",
                len(fresh["redis"]),
                fr["p50_ms"],
                fr["p99_ms"],
                fr["max_ms"],
                fresh["timeouts"],
            ],
        ],
    )
    print(
        f"  background events sent: {bg_sent:,} in {args.freshness_seconds + 3:.0f} s "
        f"(asked {rate:.0f}/s)"
    )
    print()
    print("targets:")
    noop_ok = c.verdict(tp["rate"] >= 0.5 * noop_rate, "throughput vs no-op faust agent")
    parse_ok = c.verdict(tp["rate"] >= 0.25 * parse_rate, "throughput vs raw consume + decode")
    fresh_ok = c.verdict(fr["p99_ms"] <= 250 and rate >= 5000, "freshness at 5,000/s")
    print(
        f"  worker {tp['rate']:,.0f} events/s = {100 * tp['rate'] / noop_rate:.1f}% of the no-op "
        f"faust batch agent {noop_rate:,.0f}/s (target >= 50%: {noop_ok}) and "
        f"{100 * tp['rate'] / parse_rate:.1f}% of raw consume + json.loads {parse_rate:,.0f}/s "
        f"(target >= 25%: {parse_ok})"
    )
    at_rate = ""
    if rate < 5000:
        at_rate_ok = c.verdict(fr["p99_ms"] <= 250, "freshness at the measured rate")
        at_rate = f"; p99 <= 250 ms at {rate:.0f}/s: {at_rate_ok}"
    print(
        f"  freshness p99 {fr['p99_ms']:.0f} ms at {rate:.0f} events/s (target <= 250 ms at "
        f"5,000/s: {fresh_ok}{at_rate})"
    )
    if prof_lines:
        print()
        print("profile of the worker while it consumed the topic (py-spy, 20 s):")
        for line in prof_lines:
            print("  " + line)
    if args.plots:
        path = c.plot_cdf(
            Path(args.plots) / "processor-freshness.png",
            f"freshness at {rate:.0f} events/s background",
            [
                c.Series("spendgate: produced -> visible in Redis", fresh["redis"]),
                c.Series("baseline: produced -> consumable (raw)", fresh["kafka"]),
            ],
        )
        print(f"plot: {path.relative_to(c.ROOT)}")
    del lines
    return c.exit_status(args.check)


if __name__ == "__main__":
    sys.exit(main())
