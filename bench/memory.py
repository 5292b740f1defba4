"""Memory benchmark: bytes per budget key in Redis and in the worker's RocksDB table.

For a 24 h window of 1 min buckets, sparse (60 non-empty buckets) and dense (all 1,440):

* Redis: ``MEMORY USAGE`` of the window string the worker writes (``schemas.window_codec``),
  beside its payload length and the ``MEMORY USAGE`` of an empty window (the per-key floor);
* RocksDB: the table value the worker stores (``KeyState.to_json()`` encoded as faust's
  JSON codec does, with orjson), built by applying real records with ``streams.ledger.apply``,
  beside the same value without the dedupe memory (``seen``/``settled``) - which holds every
  event id within the horizon (longest window + 1 h lateness) and dominates; and the on-disk
  bytes per key of a RocksDB folder (rocksdict, default options, compacted) holding
  ``--disk-keys`` such values.

Run: ``.venv/bin/python -m bench.memory`` (``--smoke`` for the CI mode, ``--help``).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench import _common as c

WINDOW_MS = 86_400_000
BUCKET_MS = 60_000
HORIZON_MS = WINDOW_MS + 3_600_000  # the worker's default lateness (SPENDGATE_LATENESS_MS)


def _state(buckets: list[int], per_bucket: int, flow: str, rng: random.Random) -> Any:
    """A KeyState after ``per_bucket`` requests in each bucket of ``buckets`` (offsets)."""
    from streams.ledger import KeyedRecord, KeyState, apply

    state = KeyState()
    end = 1_764_460_800_000  # a fixed day boundary (2025-11-30T00:00Z), minutes aligned
    start = end - WINDOW_MS
    common = {
        "policy": "p",
        "key": "p|tenant=acme",
        "window_ms": WINDOW_MS,
        "bucket_ms": BUCKET_MS,
        "horizon_ms": HORIZON_MS,
        "limit": 10**9,
    }
    for b in sorted(buckets):
        for k in range(per_bucket):
            t = start + b * BUCKET_MS + k * (BUCKET_MS // max(per_bucket, 1))
            amount = rng.randint(100, 4000)
            if flow == "direct":
                apply(
                    state,
                    KeyedRecord(uuid.uuid4().hex, "commit", occurred_ms=t, amount=amount, **common),
                )
            else:  # through admission: reserve then commit (two event ids, one settled id)
                rid = uuid.uuid4().hex
                apply(
                    state,
                    KeyedRecord(
                        uuid.uuid4().hex,
                        "reserve",
                        occurred_ms=t,
                        amount=amount,
                        reservation_id=rid,
                        expires_ms=t + 900_000,
                        **common,
                    ),
                )
                apply(
                    state,
                    KeyedRecord(
                        uuid.uuid4().hex,
                        "commit",
                        occurred_ms=t + 2_000,
                        amount=amount - 10,
                        reservation_id=rid,
                        **common,
                    ),
                )
    return state


def _disk_bytes(values: list[bytes], keys: int) -> int:
    from rocksdict import Rdict

    folder = Path(tempfile.mkdtemp(prefix="benchmem-"))
    try:
        db = Rdict(str(folder / "db"))
        for i in range(keys):
            db[f"p|tenant=t{i}".encode()] = values[i % len(values)]
        db.flush()
        db.compact_range(None, None)
        db.close()
        return sum(f.stat().st_size for f in (folder / "db").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--disk-keys", type=int, default=500, help="keys in the RocksDB folder")
    ap.add_argument("--smoke", action="store_true", help="fewer keys on disk")
    c.add_check_flag(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.disk_keys = 20
    import orjson
    import redis

    from schemas import window_codec
    from schemas.redis_keys import window_key

    rid = c.run_id("mem")
    c.print_header(
        "memory benchmark",
        {
            "window": "24h",
            "bucket": "1m",
            "dedupe_horizon_ms": HORIZON_MS,
            "disk_keys": args.disk_keys,
            "run": rid,
        },
    )
    rng = random.Random(7)
    cases = [
        ("sparse: 60 buckets, 1 direct commit each", rng.sample(range(1440), 60), 1, "direct"),
        (
            "sparse: 60 buckets, 1 admitted request each",
            rng.sample(range(1440), 60),
            1,
            "admission",
        ),
        ("dense: 1,440 buckets, 1 direct commit each", list(range(1440)), 1, "direct"),
        ("dense: 1,440 buckets, 1 admitted request each", list(range(1440)), 1, "admission"),
        ("dense: 1,440 buckets, 10 admitted requests each", list(range(1440)), 10, "admission"),
    ]
    client = redis.Redis.from_url(c.REDIS)
    rows: list[list[Any]] = []
    verdicts: list[str] = []
    try:
        client.set(window_key(f"{rid}:", "empty"), window_codec.encode({}, BUCKET_MS))
        empty_usage = int(client.memory_usage(window_key(f"{rid}:", "empty"), samples=0) or 0)
        for n, (label, buckets, per, flow) in enumerate(cases):
            t0 = time.perf_counter()
            state = _state(buckets, per, flow, rng)
            build_s = time.perf_counter() - t0
            payload = window_codec.encode(state.buckets, BUCKET_MS)
            wkey = window_key(f"{rid}:", f"case{n}")
            client.set(wkey, payload, px=2 * WINDOW_MS)
            redis_bytes = int(client.memory_usage(wkey, samples=0) or 0)
            value = orjson.dumps(state.to_json())
            bare = state.to_json()
            bare["seen"], bare["settled"] = {}, {}
            bare_value = orjson.dumps(bare)
            disk = _disk_bytes(
                [value], args.disk_keys if per == 1 else max(5, args.disk_keys // 10)
            )
            disk_keys = args.disk_keys if per == 1 else max(5, args.disk_keys // 10)
            target = 2048 if label.startswith("sparse") else 16384
            rows.append(
                [
                    label,
                    len(state.buckets),
                    len(state.seen),
                    len(state.settled),
                    redis_bytes,
                    len(payload),
                    empty_usage,
                    len(value),
                    len(bare_value),
                    disk // disk_keys,
                    f"{build_s * 1000:.0f} ms",
                ]
            )
            redis_ok = c.verdict(redis_bytes <= target, f"Redis {label}")
            rocks_ok = c.verdict(len(value) <= target, f"RocksDB {label}")
            bare_ok = "MET" if len(bare_value) <= target else "NOT MET"  # a comparison only
            verdicts.append(
                f"  {label}: Redis {redis_bytes:,} B (target <= {target:,}: {redis_ok}); "
                f"RocksDB value {len(value):,} B (target <= {target:,}: {rocks_ok}; without "
                f"the dedupe memory {len(bare_value):,} B: {bare_ok})"
            )
    finally:
        client.close()
        c.delete_redis_prefix(c.REDIS, f"{rid}:")
    print()
    c.print_table(
        [
            "key",
            "buckets",
            "dedupe ids (seen)",
            "settled ids",
            "Redis MEMORY USAGE B",
            "payload B",
            "baseline: empty window MEMORY USAGE B",
            "RocksDB value B",
            "baseline: value without dedupe B",
            "RocksDB on disk B/key",
            "build time",
        ],
        rows,
    )
    print()
    print("targets (<= 2 KB sparse, <= 16 KB dense):")
    for line in verdicts:
        print(line)
    return c.exit_status(args.check)


if __name__ == "__main__":
    sys.exit(main())
