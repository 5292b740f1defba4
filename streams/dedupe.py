"""Producer duplicates: a bounded, on-disk set of event ids per source partition.

What counts once: two records of one source partition with the same tenant and
``event_id`` whose arrival (broker ``LogAppendTime``) times are at most the horizon apart.
The later one is a *duplicate* and changes nothing; past the horizon it counts again. A
record read again at the *same* offset (a redelivery after a crash or rebalance) is not a
duplicate: it is processed again and the budget keys recognise it by position (see
``streams.ledger``). The same set remembers the reservation ids settled by ``commit`` or
``release``, so a ``reserve`` arriving after its own settlement charges nothing.

Layout: one RocksDB (rocksdict) database per worker, one column family per source
partition and time slice (a quarter of the horizon), key = a 16-byte digest of
(tenant, id), value = arrival ms and offset of the copy counted (16 bytes; more pairs only
when one slice counted the id more than once). A lookup reads at most five
slices, each guarded by a bloom filter; a slice is dropped whole once every id in it is
older than the horizon plus one slice (records re-read after a crash, up to a slice
behind the newest arrival, still find their ids), so expiry writes nothing. Memory is
bounded by the block cache and write buffers (``memory_bytes``); the bulk lives on disk.
The set is local: after a restart on another disk or a rebalance, the worker rebuilds a
partition's ids by reading the last horizon of the source topic up to where it resumes
(``covered``).

Clock: arrival times only (the stream's own), so a replay decides exactly as live did.
"""

from __future__ import annotations

import hashlib
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Cache,
    Options,
    Rdict,
    WriteBufferManager,
)

__all__ = ["SLICES", "IdStore", "Position", "Verdict", "event_digest", "settled_digest"]

Verdict = Literal["new", "redelivery", "duplicate"]

#: Slices per horizon: a lookup touches at most ``SLICES + 1`` of them.
SLICES = 4
_VALUE = struct.Struct("<qq")  # first arrival ms, offset
_META = struct.Struct("<qq")  # highest offset recorded, latest arrival ms
_META_CF = "meta"
_SAVE_EVERY = 4096


def _digest(domain: bytes, tenant: str | None, ident: str) -> bytes:
    scope = (tenant or "").encode()
    body = domain + len(scope).to_bytes(4, "little") + scope + ident.encode()
    return hashlib.blake2b(body, digest_size=16).digest()


def event_digest(tenant: str | None, event_id: str) -> bytes:
    """The key one event id is remembered under (ids are scoped by tenant)."""
    return _digest(b"e", tenant, event_id)


def settled_digest(tenant: str | None, reservation_id: str) -> bytes:
    """The key under which a settled reservation id is remembered."""
    return _digest(b"s", tenant, reservation_id)


@dataclass(frozen=True, slots=True)
class Position:
    """Where a record sits: its source partition, offset and arrival (broker) time."""

    partition: int
    offset: int
    arrival_ms: int


class IdStore:
    """Event ids (and settled reservation ids) seen per source partition, within a horizon.

    Args:
        path: the database folder; ``None`` makes a temporary one removed by ``close``.
        horizon_ms: how long (arrival time) an id is remembered.
        memory_bytes: the bound on RocksDB's memory (block cache plus write buffers).

    ``horizon_ms`` may change later (a policy with a longer window); the slice width,
    set from the first horizon, stays.
    """

    def __init__(self, path: Path | None, horizon_ms: int, memory_bytes: int = 64 << 20) -> None:
        if horizon_ms <= 0:
            raise ValueError(f"horizon_ms: {horizon_ms} must be positive")
        self.horizon_ms = horizon_ms
        self.slice_ms = max(1_000, -(-horizon_ms // SLICES))
        self._temp = path is None
        self.path = Path(tempfile.mkdtemp(prefix="spendgate-ids-")) if path is None else path
        self.path.mkdir(parents=True, exist_ok=True)
        # One cache and one write-buffer budget shared by every slice: the memory bound.
        self._cache = Cache(max(1 << 20, memory_bytes // 2))
        self._buffers = WriteBufferManager(max(1 << 20, memory_bytes // 2), False)
        self._write_buffer = max(1 << 20, memory_bytes // 16)
        self._opts = self._options()
        # A slice that stays in memory keeps every log file since its first write alive;
        # bound the log so RocksDB flushes such slices instead of growing the log.
        self._opts.set_max_total_wal_size(max(4 << 20, memory_bytes // 4))
        existing = (
            Rdict.list_cf(str(self.path), self._opts) if (self.path / "CURRENT").exists() else []
        )
        self._db = Rdict(
            str(self.path),
            self._opts,
            column_families={name: self._options() for name in existing},
            access_type=AccessType.read_write(),
        )
        self._cfs: dict[str, Rdict] = {n: self._db.get_column_family(n) for n in existing}
        if _META_CF not in self._cfs:
            self._cfs[_META_CF] = self._db.create_column_family(_META_CF, self._options())
        self._meta: dict[int, tuple[int, int]] = {}
        self._unsaved = 0
        for key, value in self._cfs[_META_CF].items():
            assert isinstance(key, bytes) and isinstance(value, bytes)
            self._meta[int(key)] = _META.unpack(value)

    def _options(self) -> Options:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)
        table.set_block_cache(self._cache)
        table.set_cache_index_and_filter_blocks(True)
        opts.set_block_based_table_factory(table)
        opts.set_write_buffer_manager(self._buffers)
        opts.set_write_buffer_size(self._write_buffer)
        return opts

    # -- positions ---------------------------------------------------------------------

    def covered(self, partition: int) -> int:
        """The highest offset of ``partition`` recorded here (-1: none)."""
        return self._meta.get(partition, (-1, 0))[0]

    def stream_ms(self, partition: int) -> int:
        """The latest arrival time recorded for ``partition`` (0: none)."""
        return self._meta.get(partition, (-1, 0))[1]

    # -- the set -----------------------------------------------------------------------

    def _cf_name(self, partition: int, slice_no: int) -> str:
        return f"p{partition}.{slice_no}"

    def _cf(self, partition: int, slice_no: int, create: bool) -> Rdict | None:
        name = self._cf_name(partition, slice_no)
        cf = self._cfs.get(name)
        if cf is None and create:
            cf = self._cfs[name] = self._db.create_column_family(name, self._options())
        return cf

    def _find(self, pos: Position, digest: bytes) -> tuple[int, int] | None:
        """The newest entry of ``digest`` at or before ``pos.offset`` that may still be
        within the horizon (entries of later offsets exist while records are re-read)."""
        first = (pos.arrival_ms - self.horizon_ms) // self.slice_ms
        for slice_no in range(pos.arrival_ms // self.slice_ms, first - 1, -1):
            cf = self._cf(pos.partition, slice_no, create=False)
            if cf is None:
                continue
            raw = cf.get(digest)
            if raw is not None:
                # Most values hold one pair; an id counted again within one slice holds more.
                best = None
                for arrival, offset in _VALUE.iter_unpack(raw):
                    if offset <= pos.offset and (best is None or offset > best[1]):
                        best = (arrival, offset)
                if best is not None:
                    return best
        return None

    def check(self, pos: Position, digest: bytes) -> Verdict:
        """Classify one record's id, remembering it when it is new.

        Returns:
            ``redelivery`` when this very record (same offset) was seen before,
            ``duplicate`` when another record with the id arrived within the horizon
            before it, else ``new`` (now remembered).
        """
        found = self._find(pos, digest)
        if found is not None:
            arrival, offset = found
            if offset == pos.offset:
                return "redelivery"
            if pos.arrival_ms - arrival <= self.horizon_ms:
                return "duplicate"
        self._put(pos, digest)
        return "new"

    def remember(self, pos: Position, digest: bytes) -> None:
        """Remember ``digest`` (a settled reservation) unless it already is, within horizon."""
        found = self._find(pos, digest)
        if found is None or pos.arrival_ms - found[0] > self.horizon_ms:
            self._put(pos, digest)

    def seen_before(self, pos: Position, digest: bytes) -> bool:
        """Whether ``digest`` was remembered by an earlier record within the horizon."""
        found = self._find(pos, digest)
        return (
            found is not None
            and found[1] < pos.offset
            and pos.arrival_ms - found[0] <= self.horizon_ms
        )

    def _put(self, pos: Position, digest: bytes) -> None:
        cf = self._cf(pos.partition, pos.arrival_ms // self.slice_ms, create=True)
        assert cf is not None
        value = _VALUE.pack(pos.arrival_ms, pos.offset)
        old = cf.get(digest)
        if old is not None:
            # Keep the earlier copies this slice counted (pairs from at or after this
            # offset are from a reading being repeated now and come back in order).
            kept = [p for p in _VALUE.iter_unpack(old) if p[1] < pos.offset]
            value = b"".join(_VALUE.pack(*p) for p in kept) + value
        cf[digest] = value

    def advance(self, pos: Position) -> None:
        """Record that ``pos`` was processed: moves ``covered`` and expires old slices."""
        covered, stream_ms = self._meta.get(pos.partition, (-1, 0))
        old_slice = stream_ms // self.slice_ms
        covered, stream_ms = max(covered, pos.offset), max(stream_ms, pos.arrival_ms)
        self._meta[pos.partition] = (covered, stream_ms)
        self._unsaved += 1
        if stream_ms // self.slice_ms != old_slice:
            self._expire(pos.partition, stream_ms)
        if self._unsaved >= _SAVE_EVERY:
            self.save()

    def save(self) -> None:
        """Persist ``covered`` per partition.

        Saved every few thousand records and on close: a ``covered`` that lags only makes
        a rebuild re-read records whose ids are already here, which it recognises.
        """
        meta = self._cfs[_META_CF]
        for partition, value in self._meta.items():
            meta[str(partition).encode()] = _META.pack(*value)
        self._unsaved = 0

    def _expire(self, partition: int, stream_ms: int) -> None:
        # A slice is needed while some id in it may be within the horizon of a later
        # arrival, plus one slice of grace: records re-read after a crash (arrivals before
        # ``stream_ms``) still find the ids their first reading saw.
        oldest = stream_ms - self.horizon_ms - self.slice_ms
        prefix = f"p{partition}."
        for name in [n for n in self._cfs if n.startswith(prefix)]:
            slice_no = int(name[len(prefix) :])
            if (slice_no + 1) * self.slice_ms - 1 < oldest:
                del self._cfs[name]
                self._db.drop_column_family(name)

    # -- figures -----------------------------------------------------------------------

    def size(self) -> int:
        """An estimate of the ids remembered (RocksDB's key count estimate)."""
        total = 0
        for name, cf in self._cfs.items():
            if name != _META_CF:
                total += cf.property_int_value("rocksdb.estimate-num-keys") or 0
        return total

    def disk_bytes(self) -> int:
        """Bytes of the database folder on disk."""
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    def flush(self) -> None:
        """Write the memtables to disk (for measurements; RocksDB's WAL already persists).

        Every column family is flushed, ``meta`` included: a log file is kept while any
        family still holds an unflushed write from it.
        """
        self.save()
        for name, cf in self._cfs.items():
            cf.flush()
            if name != _META_CF:
                cf.compact_range(None, None)
        self._db.flush()

    def close(self) -> None:
        """Close the database; a temporary one is deleted."""
        self.save()
        self._cfs.clear()
        self._db.close()
        if self._temp:
            shutil.rmtree(self.path, ignore_errors=True)
