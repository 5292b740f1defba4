"""Memory benchmark: bytes per budget key in Redis and in the worker's RocksDB table.

For a 24 h window of 1 min buckets, sparse (60 non-empty buckets) and dense (all 1,440):

* Redis: ``MEMORY USAGE`` of the window string the worker writes (``schemas.window_codec``),
  beside its payload length and the ``MEMORY USAGE`` of an empty window (the per-key floor);
* RocksDB: the table value the worker stores (``KeyState.to_bytes()``, format version 2:
  the buckets in the codec layout, then reservations, clock, alert marks and per source
  partition offsets), built by applying real records with ``streams.ledger.apply``, beside
  the same state in the version 1 JSON layout *without* its event ids (the old value's floor:
  version 1 also kept every event id within the horizon; ``streams.dedupe`` keeps those now,
  see ``bench.dedupe``); and the on-disk bytes per key of a RocksDB folder (rocksdict,
  default options, compacted) holding ``--disk-keys`` such values, each key's amounts
  redrawn so that no two values are equal (equal values would compress into each other),
  less the bytes of the same folder holding no key (RocksDB's fixed files: LOG, OPTIONS).

Records come from 4 source partitions (4 offsets per key). "Admitted request": a reserve then
its commit. The last case leaves 1 reservation in 10 open (a client that never settles): the
value keeps open reservations by id until the window drops them.

Run: ``.venv/bin/python -m bench.memory`` (``--smoke`` for the CI mode, ``--check`` to exit
non-zero when a target is missed, ``--help``).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import _common as c

WINDOW_MS = 86_400_000
BUCKET_MS = 60_000
#: Source partitions the key's records come from (the offsets kept per key).
SRC_PARTITIONS = 4
SPARSE_TARGET_B = 2048
DENSE_TARGET_B = 16384


def _state(buckets: list[int], per_bucket: int, flow: str, rng: random.Random) -> Any:
    """A KeyState after ``per_bucket`` requests in each bucket of ``buckets`` (offsets)."""
    from spendgate.streams.ledger import KeyedRecord, KeyState, apply

    state = KeyState()
    end = 1_764_460_800_000  # a fixed day boundary (2025-11-30T00:00Z), minutes aligned
    start = end - WINDOW_MS
    common = {
        "policy": "p",
        "key": "p|tenant=acme",
        "window_ms": WINDOW_MS,
        "bucket_ms": BUCKET_MS,
        "limit": 10**9,
        "thresholds": (0.5, 0.8, 1.0),
    }
    offsets = [0] * SRC_PARTITIONS

    def at() -> dict[str, int]:
        part = rng.randrange(SRC_PARTITIONS)
        offsets[part] += 1
        return {"src_partition": part, "src_offset": offsets[part]}

    for b in sorted(buckets):
        for k in range(per_bucket):
            t = start + b * BUCKET_MS + k * (BUCKET_MS // max(per_bucket, 1))
            amount = rng.randint(100, 4000)
            if flow == "direct":
                rec = KeyedRecord(
                    uuid.uuid4().hex, "commit", occurred_ms=t, amount=amount, **common, **at()
                )
                assert apply(state, rec).outcome == "applied"
            else:  # through admission: reserve, then commit of the reservation
                rid = uuid.uuid4().hex
                reserve = KeyedRecord(
                    uuid.uuid4().hex,
                    "reserve",
                    occurred_ms=t,
                    amount=amount,
                    reservation_id=rid,
                    expires_ms=t + 900_000,
                    **common,
                    **at(),
                )
                assert apply(state, reserve).outcome == "applied"
                if flow == "abandoned" and rng.random() < 0.1:
                    continue  # the client never committed nor released: it stays open
                settle = KeyedRecord(
                    uuid.uuid4().hex,
                    "commit",
                    occurred_ms=t + 2_000,
                    amount=amount - 10,
                    reservation_id=rid,
                    **common,
                    **at(),
                )
                assert apply(state, settle).outcome == "applied"
    return state


def _v1_value(state: Any) -> bytes:
    """``state`` in the version 1 JSON layout, without the event ids version 1 also kept."""
    import orjson

    from spendgate.streams.ledger import KeyState, _hold_json

    value = orjson.dumps(
        {
            "b": {str(k): v for k, v in state.buckets.items()},
            "seen": {},
            "res": {k: _hold_json(v) for k, v in state.reservations.items()},
            "settled": {},
            "hwm": state.high_ms,
            "bw": state.bucket_ms,
            "ww": state.window_ms,
            "x": state.crossings,
            "above": sorted(state.above),
            "exp": sorted(state.expired),
        }
    )
    # The worker's own converter must read it back to the same buckets: the layout is real.
    assert KeyState.from_bytes(value).buckets == state.buckets
    return value


def _disk_bytes(state: Any, keys: int, rng: random.Random) -> int:
    """On-disk bytes of a compacted rocksdict folder of ``keys`` values shaped like
    ``state``'s, each with its amounts redrawn."""
    from rocksdict import Rdict

    folder = Path(tempfile.mkdtemp(prefix="benchmem-"))
    try:
        db = Rdict(str(folder / "db"))
        for i in range(keys):
            own = replace(
                state, buckets={b: v + rng.randint(-99, 99) for b, v in state.buckets.items()}
            )
            db[f"p|tenant=t{i}".encode()] = own.to_bytes()
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
    import redis

    from spendgate.schemas import window_codec
    from spendgate.schemas.redis_keys import window_key
    from spendgate.streams.ledger import STATE_VERSION, KeyState

    rid = c.run_id("mem")
    c.print_header(
        "memory benchmark",
        {
            "window": "24h",
            "bucket": "1m",
            "state_version": STATE_VERSION,
            "src_partitions": SRC_PARTITIONS,
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
        (
            "dense: 1,440 buckets, 1 admitted request each, 1 in 10 never settled",
            list(range(1440)),
            1,
            "abandoned",
        ),
    ]
    client = redis.Redis.from_url(c.REDIS)
    rows: list[list[Any]] = []
    verdicts: list[str] = []
    try:
        client.set(window_key(f"{rid}:", "empty"), window_codec.encode({}, BUCKET_MS))
        empty_usage = int(client.memory_usage(window_key(f"{rid}:", "empty"), samples=0) or 0)
        empty_folder = _disk_bytes(KeyState(), 0, rng)
        for n, (label, buckets, per, flow) in enumerate(cases):
            t0 = time.perf_counter()
            state = _state(buckets, per, flow, rng)
            build_s = time.perf_counter() - t0
            payload = window_codec.encode(state.buckets, BUCKET_MS)
            wkey = window_key(f"{rid}:", f"case{n}")
            client.set(wkey, payload, px=2 * WINDOW_MS)
            redis_bytes = int(client.memory_usage(wkey, samples=0) or 0)
            value = state.to_bytes()
            assert KeyState.from_bytes(value) == state
            v1_value = _v1_value(state)
            disk_keys = args.disk_keys if per == 1 else max(5, args.disk_keys // 10)
            disk = _disk_bytes(state, disk_keys, rng)
            target = SPARSE_TARGET_B if label.startswith("sparse") else DENSE_TARGET_B
            records = sum(state.offsets.values())  # offsets count from 1 per partition
            rows.append(
                [
                    label,
                    records,
                    len(state.buckets),
                    len(state.reservations),
                    redis_bytes,
                    len(payload),
                    empty_usage,
                    len(value),
                    len(v1_value),
                    disk // disk_keys,
                    (disk - empty_folder) // disk_keys,
                    f"{build_s * 1000:.0f} ms",
                ]
            )
            redis_ok = c.verdict(redis_bytes <= target, f"Redis {label}")
            rocks_ok = c.verdict(len(value) <= target, f"RocksDB {label}")
            verdicts.append(
                f"  {label}: Redis {redis_bytes:,} B (target <= {target:,}: {redis_ok}); "
                f"RocksDB value {len(value):,} B (target <= {target:,}: {rocks_ok}), "
                f"{(disk - empty_folder) // disk_keys:,} B/key on disk "
                f"(empty folder {empty_folder:,} B subtracted)"
            )
    finally:
        client.close()
        c.delete_redis_prefix(c.REDIS, f"{rid}:")
    print()
    c.print_table(
        [
            "key",
            "records applied",
            "buckets",
            "open reservations",
            "Redis MEMORY USAGE B",
            "payload B",
            "baseline: empty window MEMORY USAGE B",
            "RocksDB value B (v2)",
            "baseline: value without dedupe B (v1 JSON layout, no ids)",
            "RocksDB on disk B/key",
            "on disk B/key less the empty folder",
            "build time",
        ],
        rows,
    )
    print()
    print(f"targets (<= {SPARSE_TARGET_B:,} B sparse, <= {DENSE_TARGET_B:,} B dense):")
    for line in verdicts:
        print(line)
    return c.exit_status(args.check)


if __name__ == "__main__":
    sys.exit(main())
