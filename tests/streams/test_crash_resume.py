"""A worker killed after faust committed records its table never applied (issue 42).

faust acks the records it skips (an event of an older generation after a rebalance, or one
read while the flow is suspended) and commits them with the ones the agent acked; its
commit also does not wait for every changelog write. A SIGKILL between that commit and
the agent applying those records leaves the group's committed offset ahead of the table.
The next worker resumed at the commit: the records in between were never applied, and a
lost ``reserve`` made its later ``commit`` charge at the commit's own instant: one amount
in the wrong bucket of the same key (the fault suite's two-kill test, about one run in
nine). These tests put the kill at that step: the worker's own usage fold and table
(``Worker.fold_usage_partition``, ``FaustTable``) under a ``BatchCommit``, the broker and
the group's commit in memory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from spendgate.schemas.policies import Policy
from spendgate.streams import app as app_module
from spendgate.streams.app import Worker
from spendgate.streams.commit import BatchCommit
from spendgate.streams.dedupe import IdStore, Position
from spendgate.streams.drift import DriftCycle
from spendgate.streams.faust_io import FaustTable, StreamAcks, table_items
from spendgate.streams.gaps import Positions
from spendgate.streams.id_rebuild import remember_raw
from spendgate.streams.ledger import KeyState
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.statecache import StateCache
from tests.streams.test_commit import MemoryMarks, MemoryOutbox, MemoryRedis, Recorder

MINUTE = 60_000
#: A minute boundary: the records below sit in three different one-minute buckets.
BASE_MS = 1_800_000_000_000 - 1_800_000_000_000 % MINUTE
POLICY = Policy(
    id="ten", unit="input_tokens", limit=10**9, window="1h", bucket="1m", group_by=["tenant"]
)
KEY = "ten|tenant=acme"
TOPIC = "usage"


class Message:
    """A faust message as the worker reads it (position, broker time in seconds)."""

    def __init__(self, partition: int, offset: int, broker_ms: int) -> None:
        self.topic, self.partition, self.offset = TOPIC, partition, offset
        self.timestamp = broker_ms / 1000


class Event:
    """A faust event: its message and value (weak-referenceable, as faust's are)."""

    def __init__(self, message: Message, value: bytes) -> None:
        self.message, self.value = message, value


class Record:
    """A record of the usage log as a raw consumer reads it back (``read_range``)."""

    def __init__(self, partition: int, offset: int, timestamp: int, value: bytes) -> None:
        self.partition, self.offset, self.timestamp, self.value = (
            partition,
            offset,
            timestamp,
            value,
        )


def _body(event_id: str, kind: str, at_ms: int, **extra: Any) -> bytes:
    return json.dumps(
        {
            "schema_version": 1,
            "event_id": event_id,
            "kind": kind,
            "subject": {"tenant": "acme", "model": "m"},
            "occurred_at": datetime.fromtimestamp(at_ms / 1000, UTC).isoformat(),
            **extra,
        }
    ).encode()


#: Partition 0 of ``usage``: a direct commit, then a reservation of 124 admitted in the
#: next minute and committed in full a minute later (the actual replaces the estimate
#: where it stands: 124 in the reservation's bucket, none in the commit's).
LOG = [
    Record(0, 0, BASE_MS + 1_000, _body("e0", "commit", BASE_MS, usage={"input_tokens": 50})),
    Record(
        0,
        1,
        BASE_MS + 61_000,
        _body(
            "e1",
            "reserve",
            BASE_MS + MINUTE,
            reservation_id="r1",
            expires_at=datetime.fromtimestamp((BASE_MS + 5 * MINUTE) / 1000, UTC).isoformat(),
            usage={"input_tokens": 124},
        ),
    ),
    Record(
        0,
        2,
        BASE_MS + 121_000,
        _body(
            "e2",
            "commit",
            BASE_MS + 2 * MINUTE,
            reservation_id="r1",
            usage={"input_tokens": 124},
        ),
    ),
]
#: The exact ledger of ``KEY``: bucket start -> amount.
LEDGER = {BASE_MS: 50, BASE_MS + MINUTE: 124}


def event(offset: int) -> Event:
    """The stream's event of the log's record at ``offset``."""
    r = LOG[offset]
    return Event(Message(r.partition, r.offset, r.timestamp), r.value)


class Group:
    """The consumer group's committed offsets, as faust commits them (not as the agent
    acked them)."""

    def __init__(self) -> None:
        self.committed: dict[int, int] = {}

    async def committed_offset(self, bootstrap: str, group: str, tp: Any, bound: Any) -> int:
        return self.committed.get(tp.partition, 0)


async def read_range(bootstrap: str, tp: Any, wanted: range, bound: Any) -> list[Record]:
    return [r for r in LOG if r.partition == tp.partition and r.offset in wanted]


async def rebuild_ids(
    bootstrap: str, topic: str, ids: IdStore, resume: Position, bound: Any
) -> int:
    # What streams.id_rebuild.rebuild_ids does, over the log in memory.
    done = 0
    for r in LOG:
        if r.partition == resume.partition and ids.covered(r.partition) < r.offset < resume.offset:
            remember_raw(ids, Position(r.partition, r.offset, r.timestamp), r.value)
            done += 1
    return done


class Acks:
    """The agent's acks (``StreamAcks``): only what a batch applied."""

    def __init__(self) -> None:
        self.acked: list[int] = []

    async def commit(self, events: Sequence[Any]) -> None:
        self.acked += [e.message.offset for e in events]


class Redis(MemoryRedis):
    """Redis: each window as it was written (a copy, not the live state)."""

    async def write_batch(self, writes: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        reply = await super().write_batch(writes, *args, **kwargs)
        for w in writes:
            self.windows[w.key] = KeyState.from_bytes(w.state.to_bytes())
        return reply


class Disk:
    """What outlives a SIGKILL: the table's database (faust's RocksDB store, a dict here)
    and Redis; every worker started on it is a new process with nothing else."""

    def __init__(self) -> None:
        self.table: dict[str, bytes] = {}
        self.rec = Recorder()
        self.redis = Redis(self.rec, set())

    def worker(self, ids: IdStore) -> tuple[Worker, BatchCommit, Acks]:
        """A freshly started worker's usage commit, as ``Worker.usage_commit`` makes it."""
        worker = Worker.__new__(Worker)  # its faust app, Redis and broker are stood in
        worker.settings = WorkerSettings(kafka_bootstrap="stand-in:9092", app_id="app")
        worker.book = SimpleNamespace(version=1, policies={POLICY.id: POLICY})
        worker._horizon_version, worker._rules = 1, None
        worker.prices, worker.key_ids = None, None
        worker.table = self.table
        worker.states = StateCache(10_000)
        worker.load = worker.states.loader(lambda key: KeyState.from_bytes(self.table.get(key)))
        worker.split_positions = Positions()
        worker.names = {"usage": TOPIC, "keyed": "keyed"}
        worker.ids = ids
        acks = Acks()
        commit = BatchCommit(
            worker.fold_usage_partition,
            FaustTable(self.table, worker.states),
            self.redis,
            MemoryMarks(self.rec),
            MemoryOutbox(self.rec),
            acks,
            done=worker.usage_done,
        )
        return worker, commit, acks

    def buckets(self) -> tuple[dict[int, int], dict[int, int]]:
        """``KEY``'s buckets in the table and in Redis."""
        return (
            KeyState.from_bytes(self.table[KEY]).buckets,
            dict(self.redis.windows[KEY].buckets),
        )


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Group:
    group = Group()
    monkeypatch.setattr(app_module, "committed_offset", group.committed_offset)
    monkeypatch.setattr(app_module, "read_range", read_range)
    monkeypatch.setattr(app_module, "rebuild_ids", rebuild_ids)
    return group


@pytest.fixture
def ids() -> Any:
    stores: list[IdStore] = []

    def make() -> IdStore:
        stores.append(IdStore(None, 24 * 3_600_000))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


class TestResumeAfterAKill:
    async def test_records_faust_committed_but_the_table_never_applied_are_read_back(
        self, group: Group, ids: Any
    ) -> None:
        disk = Disk()
        _, first, acks = disk.worker(ids())
        # Worker 1 applies record 0 (table, Redis), and its agent acks it.
        await first.run([event(0)])
        assert acks.acked == [0]
        # faust then commits offset 2: record 1 was acked as skipped (an event of the
        # generation before a rebalance; its new copy not yet folded), with record 0.
        group.committed[0] = 2
        # SIGKILL here: the table holds record 0 only; the group resumes at record 2.
        _, second, _ = disk.worker(ids())
        await second.run([event(2)])
        # Nothing lost, nothing moved: the reservation's 124 stands where it was admitted
        # (before the fix, the reserve was never applied, and the commit charged its 124
        # at its own minute: LEDGER's second bucket 0, a third bucket with 124).
        table, redis = disk.buckets()
        assert table == redis == LEDGER

    async def test_a_commit_behind_the_table_reads_back_only_what_it_must(
        self, group: Group, ids: Any
    ) -> None:
        disk = Disk()
        _, first, _ = disk.worker(ids())
        await first.run([event(0), event(1)])
        # Killed before faust committed anything: the group resumes at record 0, and
        # the restarted worker reads nothing back (records 0 and 1 come again as
        # redeliveries, applied once).
        _, second, _ = disk.worker(ids())
        parts = await second.run([event(0), event(1), event(2)])
        assert [p.result.counts.outcomes["redelivery"] for p in parts] == [2]
        assert disk.buckets() == (LEDGER, LEDGER)

    async def test_the_table_holds_the_last_offset_each_batch_applied(
        self, group: Group, ids: Any
    ) -> None:
        disk = Disk()
        _, first, _ = disk.worker(ids())
        await first.run([event(0), event(1)])
        assert disk.table["~applied|usage|0"] == b"1"
        # A batch that changes no key (its records are redeliveries) still notes it.
        _, second, _ = disk.worker(ids())
        await second.run([event(1)])
        assert disk.table["~applied|usage|0"] == b"1"
        await second.run([event(2)])
        assert disk.table["~applied|usage|0"] == b"2"


class TestPositionsAreNoBudgetKeys:
    def test_restores_and_the_drift_check_skip_them(self) -> None:
        values = {KEY: KeyState().to_bytes(), "~applied|usage|0": b"7"}
        table = SimpleNamespace(data=None, items=values.items)
        assert list(table_items(table, {0})) == [(KEY, values[KEY])]
        assert DriftCycle().next_keys(values, 10) == [KEY]


class SlowBuffer:
    """faust's producer buffer: one queued message handed to the producer per flush call,
    each call giving up as faust's does (0.1 s without a send) every other time."""

    def __init__(self, queued: int, log: list[str]) -> None:
        self.queued, self.log, self.calls = queued, log, 0

    @property
    def size(self) -> int:
        return self.queued

    async def flush_atmost(self, max_messages: int | None) -> int:
        self.calls += 1
        if self.calls % 2:
            return 0  # timed out: nothing sent within 0.1 s
        self.queued -= 1
        self.log.append("sent")
        return 1


class FaustStream:
    """A faust stream's acks and its app's producer."""

    def __init__(self, buffer: SlowBuffer, log: list[str]) -> None:
        self.app = SimpleNamespace(producer=SimpleNamespace(buffer=buffer))
        self.log = log

    async def ack(self, event: Any) -> None:
        self.log.append(f"ack {event.message.offset}")


class TestAcksWaitForTheChangelog:
    async def test_a_batch_is_acked_only_once_its_changelog_writes_left_fausts_buffer(
        self,
    ) -> None:
        # faust's commit flushes its producer first, but gives up on the buffer after
        # 0.1 s without a send: acked before the buffer drained, a batch's offsets could
        # be committed ahead of its changelog writes.
        log: list[str] = []
        acks = StreamAcks(FaustStream(SlowBuffer(3, log), log))
        await acks.commit([event(0), event(1)])
        assert log == ["sent", "sent", "sent", "ack 0", "ack 1"]

    async def test_a_buffer_that_never_drains_acks_nothing(self) -> None:
        class Stuck(SlowBuffer):
            async def flush_atmost(self, max_messages: int | None) -> int:
                await asyncio.sleep(0.01)
                return 0

        log: list[str] = []
        acks = StreamAcks(FaustStream(Stuck(1, log), log), drain_timeout_s=0.05)
        with pytest.raises(TimeoutError):
            await acks.commit([event(0)])
        assert log == []
