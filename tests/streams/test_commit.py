"""The batch commit's steps, in order, over in-memory stand-ins (no broker, no Redis)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Iterable, Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition

from spendgate.schemas.alerts import Alert
from spendgate.schemas.overage import OverageMark
from spendgate.schemas.policies import Policy
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.commit import BatchCommit, Folded, Last, drop_carried
from spendgate.streams.effects import Counts, FoldResult, KeyWrite, Refusal
from spendgate.streams.fold import UsageRecord, fold_usage
from spendgate.streams.health import WorkerHealth
from spendgate.streams.keeper import RedisKeeper
from spendgate.streams.ledger import KeyState
from spendgate.streams.marks import Claim
from spendgate.streams.remote import RemoteBatch
from spendgate.streams.rules import Rules
from spendgate.streams.scripts.mark import MarkReply, MarkWrite
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.unsent import decode_alerts, encode_alerts, unsent_key

BASE_MS = 1_800_000_000_000
#: Grouped by tenant: applied in the usage record's own partition.
LOCAL = Policy(id="ten", unit="total_tokens", limit=1_000, group_by=["tenant"], alerts=[0.5])
#: Grouped by model: spans tenants, so it crosses the keyed topic.
REMOTE = Policy(id="mod", unit="total_tokens", limit=1_000_000, group_by=["model"])


def event(partition: int, offset: int, tenant: str, tokens: int = 10, value: bytes = b"") -> Any:
    """A faust event as the commit reads it: its message's position and time, its value."""
    raw = (
        value
        or json.dumps(
            {
                "event_id": f"e-{partition}-{offset}",
                "kind": "commit",
                "subject": {"tenant": tenant, "model": "m1"},
                "occurred_at": datetime.fromtimestamp(BASE_MS / 1000, UTC).isoformat(),
                "usage": {"input_tokens": tokens},
            }
        ).encode()
    )
    message = SimpleNamespace(
        topic="usage", partition=partition, offset=offset, timestamp=BASE_MS / 1000 + offset
    )
    return SimpleNamespace(message=message, value=raw)


class Recorder:
    """Every stand-in's calls in one list, in the order they happened."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def steps(self) -> list[str]:
        return [entry[0] for entry in self.log]

    def of(self, step: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self.log if entry[0] == step]


class Folder:
    """Step 1: the real usage fold over the partition's events, states kept in a dict."""

    def __init__(self, rec: Recorder, policies: Sequence[Policy], fail_on: int | None = None):
        self.rec = rec
        self.rules = Rules(policies, None)
        self.states: dict[str, KeyState] = {}
        self.fail_on = fail_on

    def load(self, key: str) -> KeyState:
        return self.states.setdefault(key, KeyState())

    async def __call__(self, partition: int, events: Sequence[Any]) -> tuple[FoldResult, Last]:
        self.rec.log.append(("fold", partition, [e.message.offset for e in events]))
        if partition == self.fail_on:
            raise RuntimeError("the fold failed")
        records = [
            UsageRecord(partition, e.message.offset, int(e.message.timestamp * 1000), e.value)
            for e in events
        ]
        result = fold_usage(
            records, self.load, self.rules, max_future_skew_ms=300_000, max_value_bytes=1 << 20
        )
        last = records[-1]
        return result, Last("usage", partition, last.offset, last.broker_ms)


class Scripted:
    """Step 1 as a test scripts it: each call returns the next of ``writes``."""

    def __init__(self, *writes: list[KeyWrite]) -> None:
        self.writes = list(writes)

    async def __call__(self, partition: int, events: Sequence[Any]) -> tuple[FoldResult, Last]:
        result = FoldResult(self.writes.pop(0), [], [], [], Counts())
        last = events[-1].message
        return result, Last("usage", partition, last.offset, int(last.timestamp * 1000))


class MemoryTable:
    """The key-state table: values by key, and which partition's events each came with."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.values: dict[str, bytes] = {}

    def write(
        self, events: Sequence[Any], writes: Sequence[KeyWrite], alerts: Sequence[Alert] = ()
    ) -> None:
        partition = events[-1].message.partition
        changed = sorted(w.key for w in writes if w.changed)
        self.rec.log.append(("table", partition, changed))
        for w in writes:
            if w.changed:
                self.values[w.key] = w.table_value()
        if alerts:
            key = unsent_key("usage", partition)
            kept = {a.alert_id: a for a in decode_alerts(self.values.get(key))}
            kept.update((a.alert_id, a) for a in alerts)
            self.values[key] = encode_alerts(kept.values())

    def unsent(self, events: Sequence[Any]) -> list[Alert]:
        return decode_alerts(self.values.get(unsent_key("usage", events[-1].message.partition)))

    def sent(self, events: Sequence[Any], alert_ids: Iterable[str]) -> None:
        key = unsent_key("usage", events[-1].message.partition)
        acked = set(alert_ids)
        left = [a for a in decode_alerts(self.values.get(key)) if a.alert_id not in acked]
        self.values[key] = encode_alerts(left)

    def forget(self) -> None:
        self.rec.log.append(("forget",))


class MemoryRedis:
    """Redis: what each write got; ``fail`` raises on the batch write; ``seen_in_flight``
    is what the commit held in flight while the windows were written."""

    def __init__(self, rec: Recorder, in_flight: set[str]) -> None:
        self.rec = rec
        self.in_flight = in_flight
        self.fail: BaseException | None = None
        self.seen_in_flight: set[str] = set()
        self.windows: dict[str, KeyState] = {}

    async def write_batch(
        self, writes: Sequence[KeyWrite], marks: Sequence[MarkWrite] = (), presence: str = ""
    ) -> MarkReply | None:
        self.seen_in_flight = set(self.in_flight)
        self.rec.log.append(("redis", sorted(w.key for w in writes), list(marks), presence))
        if self.fail is not None:
            raise self.fail
        self.windows.update((w.key, w.state) for w in writes)
        return MarkReply(True, len(marks), 0) if marks else None

    async def write_marks(self, marks: Sequence[MarkWrite], presence: str) -> MarkReply:
        self.rec.log.append(("marks", list(marks), presence))
        return MarkReply(True, len(marks), 0)


class MemoryMarks:
    """The marks bookkeeping: a mark per partition at its last record's broker ms - 1."""

    presence = "worker:test"

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def advance(self, lasts: Iterable[Last]) -> list[MarkWrite]:
        lasts = list(lasts)
        self.rec.log.append(("advance", lasts))
        return [
            MarkWrite(f"usage:{t.partition}", 1, t.broker_ms - 1, position=t.offset + 1)
            for t in lasts
        ]

    def advanced(self, lasts: Iterable[Last], marks: Iterable[MarkWrite]) -> None:
        self.rec.log.append(("advanced", list(lasts)))

    def noted(self, reply: MarkReply | None) -> None:
        self.rec.log.append(("noted", reply))


class MemoryOutbox:
    """The producer: each send logged, its ack logged when awaited (``fail``: it raises)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.fail = False

    async def _ack(self, what: str) -> None:
        await asyncio.sleep(0)
        if self.fail:
            raise ConnectionError(f"no ack for {what}")
        self.rec.log.append(("acked", what))

    async def keyed(self, batch: RemoteBatch) -> Awaitable[Any]:
        self.rec.log.append(("send", "keyed", batch.key))
        return self._ack(batch.key)

    async def dead_letter(self, refusal: Refusal) -> Awaitable[Any]:
        self.rec.log.append(("send", "dlq", refusal.offset))
        return self._ack(f"dlq {refusal.offset}")

    async def alert(self, alert: Alert) -> Awaitable[Any]:
        self.rec.log.append(("send", "alert", alert.key))
        return self._ack(f"alert {alert.key}")


class MemoryOffsets:
    """The offset committer: which events were acked."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    async def commit(self, events: Sequence[Any]) -> None:
        self.rec.log.append(("offsets", [(e.message.partition, e.message.offset) for e in events]))


class Rig:
    """A BatchCommit over the stand-ins above."""

    def __init__(
        self,
        policies: Sequence[Policy] = (LOCAL,),
        fail_on: int | None = None,
        marks: Any = None,
    ):
        self.rec = Recorder()
        self.in_flight: set[str] = set()
        self.fold = Folder(self.rec, policies, fail_on)
        self.table = MemoryTable(self.rec)
        self.redis = MemoryRedis(self.rec, self.in_flight)
        self.outbox = MemoryOutbox(self.rec)
        self.done: list[Sequence[Folded]] = []
        self.commit = BatchCommit(
            self.fold,
            self.table,
            self.redis,
            MemoryMarks(self.rec) if marks is None else marks,
            self.outbox,
            MemoryOffsets(self.rec),
            in_flight=self.in_flight,
            done=self.done_called,
        )

    def done_called(self, parts: Sequence[Folded]) -> None:
        self.rec.log.append(("done", [p.partition for p in parts]))
        self.done.append(parts)


BATCH = [event(0, 5, "acme"), event(1, 7, "bolt"), event(0, 6, "acme", tokens=600)]


class TestBatchCommitSteps:
    async def test_the_steps_run_in_order_partition_by_partition(self) -> None:
        rig = Rig()
        await rig.commit.run(BATCH)
        assert rig.rec.steps() == [
            "fold",  # 1. partition 0
            "table",  # 2.
            "fold",  # 1. partition 1
            "table",  # 2.
            "advance",  # 4. the marks go with the windows (no keyed batches) ...
            "redis",
            "advanced",  # ... and are noted once Redis has them
            "noted",
            "send",  # 5. the alert, once the state is in the table and in Redis
            "acked",
            "done",
            "offsets",  # 6.
        ]

    async def test_each_step_gets_its_part(self) -> None:
        rig = Rig()
        parts = await rig.commit.run(BATCH)
        assert rig.rec.of("fold") == [("fold", 0, [5, 6]), ("fold", 1, [7])]
        assert rig.rec.of("table") == [
            ("table", 0, ["ten|tenant=acme"]),
            ("table", 1, ["ten|tenant=bolt"]),
        ]
        assert KeyState.from_bytes(rig.table.values["ten|tenant=acme"]).buckets  # its folded state
        lasts = [Last("usage", 0, 6, BASE_MS + 6_000), Last("usage", 1, 7, BASE_MS + 7_000)]
        assert rig.rec.of("advance") == [("advance", lasts)]
        marks = [
            MarkWrite("usage:0", 1, BASE_MS + 5_999, position=7),
            MarkWrite("usage:1", 1, BASE_MS + 6_999, position=8),
        ]
        assert rig.rec.of("redis") == [
            ("redis", ["ten|tenant=acme", "ten|tenant=bolt"], marks, "worker:test")
        ]
        assert rig.rec.of("send") == [
            ("send", "alert", "ten|tenant=acme")
        ]  # 610 of 1,000: past half
        assert rig.rec.of("offsets") == [("offsets", [(0, 5), (1, 7), (0, 6)])]
        assert [(p.partition, p.last.offset) for p in parts] == [(0, 6), (1, 7)]
        assert rig.done == [parts]

    async def test_keys_are_in_flight_from_the_table_write_until_redis_has_them(self) -> None:
        rig = Rig()
        await rig.commit.run(BATCH)
        assert rig.redis.seen_in_flight == {"ten|tenant=acme", "ten|tenant=bolt"}
        assert rig.in_flight == set()

    async def test_with_keyed_batches_the_marks_wait_for_the_broker_acks(self) -> None:
        rig = Rig(policies=(REMOTE,))
        await rig.commit.run(BATCH)
        assert rig.rec.steps() == [
            "fold",
            "table",
            "fold",
            "table",
            "redis",  # 4. no marks with the windows ...
            "noted",
            "send",  # 5. one keyed batch per (key, source partition)
            "send",
            "acked",
            "acked",
            "advance",  # ... the marks once the keyed batches are acked
            "marks",
            "advanced",
            "noted",
            "done",
            "offsets",
        ]
        assert rig.rec.of("redis")[0][2] == []
        assert rig.rec.of("send") == [
            ("send", "keyed", "mod|model=m1"),
            ("send", "keyed", "mod|model=m1"),
        ]

    async def test_a_refused_record_is_dead_lettered_before_the_offsets(self) -> None:
        rig = Rig()
        await rig.commit.run([event(0, 1, "acme", value=b"not json")])
        assert rig.rec.of("send") == [("send", "dlq", 1)]
        assert rig.rec.steps()[-3:] == ["acked", "done", "offsets"]


class TestBatchCommitFailures:
    async def test_when_redis_fails_no_offset_is_committed(self) -> None:
        rig = Rig()
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)
        assert rig.rec.steps()[-2:] == ["redis", "forget"]
        assert not rig.rec.of("advanced")  # the marks computed, never noted
        assert not rig.rec.of("offsets") and not rig.rec.of("send") and not rig.done
        assert rig.in_flight == set()

    async def test_when_a_send_is_not_acked_no_mark_and_no_offset_follow(self) -> None:
        rig = Rig(policies=(REMOTE,))
        rig.outbox.fail = True
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)
        assert rig.rec.steps()[-1] == "forget"
        assert not rig.rec.of("marks") and not rig.rec.of("advanced")
        assert not rig.rec.of("offsets") and not rig.done

    async def test_when_a_fold_fails_nothing_of_the_batch_reaches_redis(self) -> None:
        rig = Rig(fail_on=1)
        with pytest.raises(RuntimeError):
            await rig.commit.run(BATCH)
        # Partition 0 was written to the table (its changelog record queued, but never
        # vouched for by an offset): the batch comes again, its records redeliveries for
        # the table (applied once, never twice).
        assert rig.rec.steps() == ["fold", "table", "fold", "forget"]
        assert rig.in_flight == set()
        assert not rig.rec.of("redis") and not rig.rec.of("offsets")

    async def test_after_redis_failed_the_next_batch_writes_what_it_missed(self) -> None:
        rig = Rig()
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)
        rig.redis.fail = None
        rig.rec.log.clear()
        # The batch again: the table holds its fold, so every record is a redelivery (no
        # table write); the writes the failed step 4 missed go with the batch's.
        await rig.commit.run(BATCH)
        assert rig.rec.of("table") == [("table", 0, []), ("table", 1, [])]
        (redis,) = rig.rec.of("redis")
        assert redis[1] == ["ten|tenant=acme", "ten|tenant=bolt"]
        assert (
            rig.redis.windows["ten|tenant=acme"].buckets
            == rig.fold.states["ten|tenant=acme"].buckets
        )
        assert rig.rec.steps()[-1] == "offsets"
        assert rig.commit.unmirrored == {}

    async def test_a_carried_write_merges_into_the_next_write_of_its_key(self) -> None:
        rig = Rig()
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH[:1])
        rig.redis.fail = None
        await rig.commit.run([event(0, 6, "acme", tokens=600)])
        (_, (_, keys, _, _)) = rig.rec.of("redis")
        assert keys == ["ten|tenant=acme"]  # one write of the key, its newest state
        assert sum(rig.redis.windows["ten|tenant=acme"].buckets.values()) == 610

    async def test_a_carried_write_merges_into_a_write_of_its_key_leaving_the_window(
        self,
    ) -> None:
        spec = WindowSpec(60_000, 1_000)
        older, newer = KeyState(offsets={0: 5}), KeyState(offsets={0: 6})
        overage = OverageMark(1_500, BASE_MS)
        first = KeyWrite("k", older, spec, changed=True, window_changed=True, overage=overage)
        # The next batch changed the key's state (a late record, say) but not its window:
        # no Redis write of its own, yet the carried one must not go out with the older
        # state and version.
        second = KeyWrite("k", newer, spec, changed=True)
        rig = Rig()
        commit = BatchCommit(
            Scripted([first], [second]),
            rig.table,
            rig.redis,
            MemoryMarks(rig.rec),
            rig.outbox,
            MemoryOffsets(rig.rec),
        )
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await commit.run([event(0, 5, "acme")])
        rig.redis.fail = None
        await commit.run([event(0, 6, "acme")])
        assert rig.rec.of("redis")[-1][1] == ["k"]  # one write of the key ...
        assert rig.redis.windows["k"] is newer  # ... with its newest state
        assert second.window_changed and second.overage == overage
        assert commit.unmirrored == {}

    async def test_each_carried_write_keeps_its_source_partition(self) -> None:
        rig = Rig()
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)
        carried = {key: c.partition for key, c in rig.commit.unmirrored.items()}
        assert carried == {"ten|tenant=acme": 0, "ten|tenant=bolt": 1}

    async def test_the_carried_writes_of_a_partition_gone_are_dropped(self) -> None:
        rig = Rig()
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)
        # Partition 0 moved to another worker (it restores the key from the changelog).
        assert drop_carried(rig.commit.unmirrored, {1}) == 1
        assert set(rig.commit.unmirrored) == {"ten|tenant=bolt"}
        rig.redis.fail = None
        await rig.commit.run([event(1, 8, "bolt")])
        assert rig.rec.of("redis")[-1][1] == ["ten|tenant=bolt"]
        assert "ten|tenant=acme" not in rig.redis.windows

    async def test_the_carried_writes_outlive_the_commit(self) -> None:
        # faust restarts a crashed agent, which makes a new commit over the same dict.
        rig = Rig()
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)
        rig.redis.fail = None
        again = BatchCommit(
            rig.fold,
            rig.table,
            rig.redis,
            MemoryMarks(rig.rec),
            rig.outbox,
            MemoryOffsets(rig.rec),
            unmirrored=rig.commit.unmirrored,
        )
        rig.rec.log.clear()
        await again.run(BATCH)
        assert rig.rec.of("redis")[0][1] == ["ten|tenant=acme", "ten|tenant=bolt"]


class KeeperRedis:
    """Redis as the keeper's idle tick sees it: its clock, and the marks written."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms
        self.marks: list[MarkWrite] = []

    async def sample(self, fields: Sequence[str]) -> tuple[int, list[int | None]]:
        return self.now_ms, [None] * len(fields)

    async def write_marks(self, marks: Sequence[MarkWrite], presence: str) -> MarkReply:
        self.marks += marks
        return MarkReply(True, len(marks), 0)


class EndOffsets:
    """The broker's end (and start) offsets, as the keeper asks for them."""

    def __init__(self, end: int) -> None:
        self.end = end

    async def ends(self, tps: Iterable[Any]) -> dict[Any, int]:
        return dict.fromkeys(tps, self.end)

    async def starts(self, tps: Iterable[Any]) -> dict[Any, int]:
        return dict.fromkeys(tps, 0)


class TestMarksAfterAFailedRedisStep:
    """The real RedisKeeper behind the commit: usage partition 0 owned, committed and
    vouched for up to offset 5 (mark at BASE_MS), the batch's records 5 and 6 the last in
    the partition (end offset 7)."""

    TP = TopicPartition("usage", 0)

    def keeper(self) -> RedisKeeper:
        consumer = SimpleNamespace(
            assignment=lambda: {self.TP},
            topic_partitions=lambda topic: 1,
            _committed_offset={self.TP: 5},
        )
        app = SimpleNamespace(consumer=consumer, consumer_generation_id=1)
        settings = WorkerSettings(topic_prefix="", mark_clock_skew_ms=0)
        redis = KeeperRedis(BASE_MS + 60_000)
        keeper = RedisKeeper(app, settings, SimpleNamespace(), redis, None, WorkerHealth())  # type: ignore[arg-type]
        keeper.offsets = EndOffsets(7)  # type: ignore[assignment]
        keeper.watermarks.assign({"usage:0": Claim(1, BASE_MS, position=5)}, moved=[])
        return keeper

    async def idle_mark(self, keeper: RedisKeeper) -> MarkWrite:
        await keeper.advance_idle()
        redis = keeper.materializer
        assert isinstance(redis, KeeperRedis)
        return redis.marks.pop()

    async def test_the_keeper_notes_nothing_and_the_idle_mark_waits(self) -> None:
        keeper = self.keeper()
        rig = Rig(marks=keeper)
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run([event(0, 5, "acme"), event(0, 6, "acme")])
        assert keeper.handled == {}
        assert keeper.watermarks.position("usage:0") == 5
        (health,) = keeper.watermarks.health(BASE_MS, 30_000)
        assert health.watermark_ms == BASE_MS
        # Caught up as far as the keeper knows only up to 5 of 7: no idle claim (before,
        # it counted the batch as applied and vouched for a Redis without its windows).
        assert await self.idle_mark(keeper) == MarkWrite("usage:0", 1, None, 2, 5)

    async def test_once_the_carry_is_written_the_positions_and_the_marks_move(self) -> None:
        keeper = self.keeper()
        rig = Rig(marks=keeper)
        batch = [event(0, 5, "acme"), event(0, 6, "acme")]
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(batch)
        rig.redis.fail = None
        await rig.commit.run(batch)
        (_, keys, marks, _) = rig.rec.of("redis")[-1]
        assert keys == ["ten|tenant=acme"]
        assert marks == [MarkWrite("usage:0", 1, BASE_MS + 5_999, position=7)]
        assert keeper.handled == {("usage", 0): 7}
        assert keeper.watermarks.position("usage:0") == 7
        assert await self.idle_mark(keeper) == MarkWrite("usage:0", 1, BASE_MS + 59_999, 0, 7)
