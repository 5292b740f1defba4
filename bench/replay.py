"""Replay benchmark: ``streams.replay.replay()`` rebuild time against a raw consume + decode.

A topic of N commit events over K budget keys (the processor benchmark's workload) is
produced; then, in the same run, a plain aiokafka consumer reads it (baselines, configured
as replay's own consumer: raw consume, and raw consume + ``json.loads``) and ``replay()``
(the worker's fold on aiokafka batches) rebuilds every key and restores Redis. The target
compares replay with raw consume + decode.

Run: ``.venv/bin/python -m bench.replay`` (``--smoke`` for the CI mode, ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench import _common as c
from bench import _kafka as k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--smoke", action="store_true", help="tiny CI run (a few hundred events)")
    ap.add_argument(
        "--simulate",
        action="store_true",
        help="also time spendgate simulate on the same topic (the policies in force as draft)",
    )
    ap.add_argument(
        "--reserves",
        action="store_true",
        help="produce reserves instead of commits (each one a request simulate judges)",
    )
    c.add_check_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.events, args.keys = 300, 50
    from spendgate.streams.replay import replay

    rid = c.run_id("rep")
    s = k.settings(rid, Path(tempfile.mkdtemp(prefix=f"{rid}-")) / "tables")
    c.print_header("replay benchmark", {"events": args.events, "keys": args.keys, "run": rid})
    try:
        asyncio.run(k.setup_topics(s))
        produce_s = asyncio.run(k.fill(s, args.events, args.keys, reserves=args.reserves))
        print(f"  produced {args.events:,} events in {produce_s:.1f} s", flush=True)
        n_raw, raw_s = asyncio.run(k.raw_consume(s))
        t0 = time.perf_counter()
        summary = asyncio.run(replay(s))
        replay_s = time.perf_counter() - t0
        sim = None
        if args.simulate:
            sim = asyncio.run(_simulate(s))
        n_raw2, raw2_s = asyncio.run(k.raw_consume(s))
        n_parse, parse_s = asyncio.run(k.raw_consume(s, parse=True))
    finally:
        c.delete_redis_prefix(c.REDIS, f"{rid}:")
        c.delete_topics(c.KAFKA, rid)
    raw_best = min(raw_s, raw2_s)
    print()
    sim_rows = []
    if sim is not None:
        sim_records, sim_keys, sim_s = sim
        sim_rows.append(
            [
                "spendgate simulate (read + judge + fold, draft = the policies in force)",
                sim_records,
                sim_keys,
                sim_s,
                sim_records / sim_s,
                f"{sim_s / raw_best:.2f}",
            ]
        )
    c.print_table(
        ["run", "records", "keys", "seconds", "records/s", "x raw"],
        [
            [
                "baseline: raw aiokafka consume (before)",
                n_raw,
                "-",
                raw_s,
                n_raw / raw_s,
                f"{raw_s / raw_best:.2f}",
            ],
            [
                "spendgate replay() (rebuild + restore Redis)",
                summary.records,
                summary.keys,
                replay_s,
                summary.records / replay_s,
                f"{replay_s / raw_best:.2f}",
            ],
            *sim_rows,
            [
                "baseline: raw aiokafka consume (after)",
                n_raw2,
                "-",
                raw2_s,
                n_raw2 / raw2_s,
                f"{raw2_s / raw_best:.2f}",
            ],
            [
                "baseline: raw consume + json.loads",
                n_parse,
                "-",
                parse_s,
                n_parse / parse_s,
                f"{parse_s / raw_best:.2f}",
            ],
        ],
    )
    print()
    ratio = replay_s / parse_s
    print(
        f"targets: replay {replay_s:.2f} s = {ratio:.1f}x the raw consume + decode "
        f"{parse_s:.2f} s (target <= 2x: {c.verdict(ratio <= 2.0, 'replay <= 2x raw + decode')}); "
        f"{replay_s / raw_best:.1f}x the raw consume alone"
    )
    if sim is not None:
        print(f"simulate: {sim[2]:.2f} s = {sim[2] / replay_s:.2f}x replay's {replay_s:.2f} s")
    return c.exit_status(args.check)


async def _simulate(s: object) -> tuple[int, int, float]:
    """Time ``spendgate simulate`` over the benchmark's topic with its policies as draft."""
    from spendgate.simulate import simulate
    from spendgate.streams.policybook import read_policies

    draft = list(
        (await read_policies(s.kafka(), s.topic("policies"), key_ids=s.key_ids())).values()
    )  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    report = await simulate(s, draft)  # type: ignore[arg-type]
    seconds = time.perf_counter() - t0
    return report.usage_records + report.refusal_records, report.keys_folded, seconds


if __name__ == "__main__":
    sys.exit(main())
