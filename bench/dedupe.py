"""Dedupe benchmark: bytes on disk per remembered event id, and the cost of a check.

Fills a ``streams.dedupe.IdStore`` (24 h horizon by default) with ``--ids`` distinct event
ids of one source partition, arrivals spread evenly over the horizon (every id is still
remembered at the end), calling ``check`` then ``advance`` per id as the worker does per
record; then ``flush()`` (memtables written, slices compacted) and reports
``disk_bytes() / ids`` beside ``size()`` (RocksDB's key-count estimate). Baselines in the
same run, on the same digests: a plain Python ``set`` (insert cost and its memory per id,
measured with ``tracemalloc``) and a single rocksdict database with default options
(``get`` then ``put`` of the same 16-byte value per id, no slices, no bloom filter,
flushed and compacted the same way). Folder bytes are split into SST files, write-ahead
logs (WAL) and the rest; the IdStore is measured as ``flush()`` leaves it and again with
its ``meta`` column family flushed too (which releases the write-ahead logs).

Run: ``.venv/bin/python -m bench.dedupe`` (``--smoke`` for a tiny run, ``--check`` to exit
non-zero when the target of 64 B per id is missed, ``--help``).
"""

from __future__ import annotations

import argparse
import shutil
import struct
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

from bench import _common as c

HOUR_MS = 3_600_000
TARGET_B_PER_ID = 64
_VALUE = struct.Struct("<qq")
START_MS = 1_764_460_800_000  # 2025-11-30T00:00Z: a fixed clock, so runs compare


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _by_kind(path: Path) -> dict[str, int]:
    """Folder bytes split into SST files, write-ahead logs and the rest."""
    out = {"sst": 0, "wal": 0, "other": 0}
    for f in path.rglob("*"):
        if f.is_file():
            kind = {".sst": "sst", ".log": "wal"}.get(f.suffix, "other")
            out[kind] += f.stat().st_size
    return out


def _id_store(digests: list[bytes], horizon_ms: int) -> dict[str, Any]:
    from spendgate.streams.dedupe import IdStore, Position

    n = len(digests)
    step_ms = max(1, horizon_ms // max(n, 1))
    store = IdStore(None, horizon_ms)
    try:
        tenths = []
        for k in range(10):
            lo, hi = n * k // 10, n * (k + 1) // 10
            t0 = time.perf_counter()
            for offset in range(lo, hi):
                pos = Position(0, offset, START_MS + offset * step_ms)
                verdict = store.check(pos, digests[offset])
                store.advance(pos)
                assert verdict == "new", verdict
            tenths.append((time.perf_counter() - t0) / max(hi - lo, 1) * 1e6)
        fill_s = sum(t * (n * (k + 1) // 10 - n * k // 10) for k, t in enumerate(tenths)) / 1e6
        # Some of the same ids again, just after: every one is a duplicate (and writes nothing).
        sample = digests[: min(n, 20_000)]
        t0 = time.perf_counter()
        for k, digest in enumerate(sample):
            pos = Position(0, n + k, START_MS + n * step_ms + k)
            assert store.check(pos, digest) == "duplicate"
            store.advance(pos)
        dup_s = time.perf_counter() - t0
        store.flush()
        out = {
            "fill_s": fill_s,
            "tenths_us": tenths,
            "dup_us": dup_s / max(len(sample), 1) * 1e6,
            "disk": store.disk_bytes(),
            "kinds": _by_kind(store.path),
            "size": store.size(),
            "slices": sum(1 for name in store._cfs if name.startswith("p0.")),
        }
        # flush() leaves the ``meta`` column family (positions, written every few thousand
        # records) in its memtable, which keeps every write-ahead log since the start alive.
        store._cfs["meta"].flush()
        out["disk_meta_flushed"] = store.disk_bytes()
        out["kinds_meta_flushed"] = _by_kind(store.path)
        return out
    finally:
        store.close()


def _raw_rocksdict(digests: list[bytes]) -> dict[str, Any]:
    from rocksdict import Options, Rdict

    folder = Path(tempfile.mkdtemp(prefix="benchids-"))
    try:
        db = Rdict(str(folder / "db"), Options(raw_mode=True))
        t0 = time.perf_counter()
        for offset, digest in enumerate(digests):
            if db.get(digest) is None:
                db[digest] = _VALUE.pack(START_MS + offset, offset)
        fill_s = time.perf_counter() - t0
        db.flush()
        db.compact_range(None, None)
        db.close()
        return {"fill_s": fill_s, "disk": _folder_bytes(folder), "kinds": _by_kind(folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _python_set(digests: list[bytes]) -> dict[str, Any]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    seen: set[bytes] = set()
    t0 = time.perf_counter()
    for digest in digests:
        if digest not in seen:
            seen.add(digest)
    fill_s = time.perf_counter() - t0
    # The set's own memory: the digests existed before (they are shared with the others).
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(seen) == len(digests)
    return {"fill_s": fill_s, "memory": grown}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.dedupe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=int, default=1_000_000, help="distinct ids to remember")
    ap.add_argument("--horizon-h", type=float, default=24.0, help="dedupe horizon, hours")
    ap.add_argument("--smoke", action="store_true", help="20,000 ids")
    ap.add_argument(
        "--check", action="store_true", help=f"exit 1 when over {TARGET_B_PER_ID} B per id"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.ids = 20_000
    from spendgate.streams.dedupe import SLICES, event_digest

    horizon_ms = int(args.horizon_h * HOUR_MS)
    c.print_header(
        "dedupe benchmark (IdStore)",
        {"ids": args.ids, "horizon_ms": horizon_ms, "slices_per_horizon": SLICES},
    )
    t0 = time.perf_counter()
    digests = [event_digest("acme", uuid.uuid4().hex) for _ in range(args.ids)]
    digest_us = (time.perf_counter() - t0) / args.ids * 1e6
    ids = _id_store(digests, horizon_ms)
    raw = _raw_rocksdict(digests)
    py = _python_set(digests)
    n = args.ids
    size = max(ids["size"], 1)
    per_id = ids["disk"] / size
    kinds, kinds2 = ids["kinds"], ids["kinds_meta_flushed"]
    print()
    c.print_table(
        [
            "store",
            "ids",
            "us per id (check+advance / get+put / insert)",
            "bytes per id",
            "of which SST / WAL / other",
            "notes",
        ],
        [
            [
                "spendgate IdStore, after flush(): disk_bytes() / size()",
                ids["size"],
                ids["fill_s"] / n * 1e6,
                per_id,
                f"{kinds['sst'] / size:.1f} / {kinds['wal'] / size:.1f} / "
                f"{kinds['other'] / size:.1f}",
                f"{n:,} ids checked; {ids['slices']} slices; "
                f"a duplicate's check + advance {ids['dup_us']:.1f} us",
            ],
            [
                "spendgate IdStore, meta column family flushed too",
                ids["size"],
                "-",
                ids["disk_meta_flushed"] / size,
                f"{kinds2['sst'] / size:.1f} / {kinds2['wal'] / size:.1f} / "
                f"{kinds2['other'] / size:.1f}",
                "the write-ahead logs are released",
            ],
            [
                "baseline: rocksdict default options (get + put)",
                n,
                raw["fill_s"] / n * 1e6,
                raw["disk"] / n,
                f"{raw['kinds']['sst'] / n:.1f} / {raw['kinds']['wal'] / n:.1f} / "
                f"{raw['kinds']['other'] / n:.1f}",
                "one database, no slices, no bloom filter; flushed and compacted",
            ],
            [
                "baseline: Python set (in + add)",
                n,
                py["fill_s"] / n * 1e6,
                py["memory"] / n,
                "-",
                "in memory (tracemalloc), digests not counted",
            ],
        ],
    )
    print()
    print(
        f"uuid4 + digest (blake2b-128 of tenant + id): {digest_us:.2f} us per id, not in the "
        "figures"
    )
    print(
        "IdStore check + advance, us per id per tenth of the ids: "
        + " ".join(f"{t:.1f}" for t in ids["tenths_us"])
    )
    print("targets:")
    ok = per_id <= TARGET_B_PER_ID
    print(
        f"  bytes per remembered id on disk, disk_bytes() / size() after flush(): "
        f"{per_id:.1f} B (target <= {TARGET_B_PER_ID} B: {c.verdict(ok)})"
    )
    flushed = ids["disk_meta_flushed"] / size
    print(
        f"  the same with the meta column family flushed too: {flushed:.1f} B "
        f"(target <= {TARGET_B_PER_ID} B: {c.verdict(flushed <= TARGET_B_PER_ID)})"
    )
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
