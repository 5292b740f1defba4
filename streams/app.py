"""The faust application: split usage events per budget key, then account per key."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import faust
import orjson
import redis.asyncio as aioredis
from aiokafka import TopicPartition

from schemas.deadletter import dead_letter
from schemas.policies import Policy
from schemas.prices import load_catalog
from schemas.shards import Topology, keyed_mark, usage_mark
from streams import metrics
from streams.alerting import evaluate
from streams.dedupe import IdStore, Position
from streams.fanout import fan_out
from streams.gaps import Positions, committed_offset, missing_range, read_range
from streams.id_rebuild import rebuild_ids
from streams.ledger import KeyedRecord, KeyState, apply
from streams.marks import MarkKeeper, Progress
from streams.materialize import RedisMaterializer
from streams.policybook import PolicyBook
from streams.settings import WorkerSettings

logger = logging.getLogger(__name__)


def build_app(
    settings: WorkerSettings,
    policies: dict[str, Policy] | None = None,
    retention_ms: int = -1,
) -> faust.App:
    """Build the worker's faust app with its topics, table, agents and policy tail.

    ``policies``, read before the app starts, lets the agents begin without waiting for
    the policy tail; the tail then keeps them current. ``retention_ms`` is ``usage``'s
    retention (-1: forever), checked again whenever the policies change.
    """
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        store="rocksdb://",
        datadir=str(settings.data_dir),
        topic_partitions=settings.partitions,
        topic_replication_factor=1,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        producer_acks=-1,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 3),
    )
    usage = app.topic(
        settings.topic("usage"),
        value_serializer="raw",
        key_serializer="raw",
        partitions=settings.partitions,
    )
    # Repartitioned by budget key, so each key's state lives in exactly one partition.
    keyed = app.topic(
        settings.keyed_topic,
        key_type=str,
        value_serializer="json",
        partitions=settings.partitions,
    )
    dlq = app.topic(settings.topic("dlq"), value_serializer="raw", key_serializer="raw")
    alerts_topic = app.topic(settings.topic("alerts"), value_serializer="raw", key_type=str)
    table = app.Table("keystate", partitions=settings.partitions, key_type=str, value_type=bytes)
    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    book = PolicyBook(settings.kafka_bootstrap, settings.topic("policies"), policies)
    materializer = RedisMaterializer(
        aioredis.Redis.from_url(settings.redis_url), settings.redis_prefix
    )
    published = {"version": -1}
    # This worker's mark in Redis: when it is gone, Redis lost its data (flush, restart
    # without persistence) and the worker rewrites everything it owns from its table.
    marker = f"{settings.redis_prefix}worker:{uuid.uuid4().hex}"
    keeper = MarkKeeper()
    #: Set on every assignment: rewrite the windows before vouching for them.
    reassigned = {"flag": True}
    #: (topic, partition) -> (next offset to handle, broker ms of the last one handled).
    handled: dict[tuple[str, int], tuple[int, int]] = {}
    ids = IdStore(
        settings.data_dir / f"{settings.app_id}-ids",
        horizon_ms(settings, book.policies.values()),
        settings.dedupe_memory_mb << 20,
    )
    horizon_version = {"version": book.version}

    def track_policies() -> None:
        """Follow a policy change: the dedupe horizon and the retention it needs."""
        if horizon_version["version"] == book.version:
            return
        horizon_version["version"] = book.version
        ids.horizon_ms = horizon_ms(settings, book.policies.values())
        longest = max((p.window_ms for p in book.policies.values()), default=0)
        short = 0 <= retention_ms < settings.retention_needed_ms(longest)
        metrics.RETENTION_SHORT.set(int(short))
        if short:
            logger.warning(
                "policies now need %d ms of retention on %s, which keeps %d ms: raise it",
                settings.retention_needed_ms(longest),
                settings.topic("usage"),
                retention_ms,
            )

    async def dead_letter_raw(reason: str, raw: bytes, msg: Any) -> None:
        metrics.DEAD_LETTERED.inc()
        logger.warning("dead-lettered record at %s/%s: %s", msg.partition, msg.offset, reason)
        record = dead_letter(
            reason,
            raw,
            topic=msg.topic,
            partition=msg.partition,
            offset=msg.offset,
            at=datetime.now(UTC),
        )
        await dlq.send(value=record.model_dump_json().encode())

    @app.task  # type: ignore[untyped-decorator]
    async def policy_tail() -> None:
        await book.run()

    def topology() -> Topology:
        parts = app.consumer.topic_partitions
        return Topology(
            usage=parts(settings.topic("usage")) or settings.partitions,
            keyed=parts(settings.keyed_topic) or settings.partitions,
        )

    def owned() -> dict[str, Any]:
        """Mark field -> topic partition, for every usage and keyed partition owned."""
        out: dict[str, Any] = {}
        for tp in app.consumer.assignment():
            if tp.topic == settings.topic("usage"):
                out[usage_mark(tp.partition)] = tp
            elif tp.topic == settings.keyed_topic:
                out[keyed_mark(tp.partition)] = tp
        return out

    async def progress(tps: dict[str, Any]) -> dict[str, Progress]:
        ends = await app.consumer.highwaters(*tps.values())
        out: dict[str, Progress] = {}
        for field, tp in tps.items():
            end = ends.get(tp)
            if end is None:
                continue
            position, broker_ms = handled.get((tp.topic, tp.partition), (None, None))
            if position is None:
                # Nothing handled since the assignment: caught up if nothing is left to read.
                fetch = await app.consumer.position(tp)
                position = fetch if fetch is not None and fetch >= end else None
            out[field] = Progress(position, end, broker_ms)
        return out

    @app.timer(interval=0.5)  # type: ignore[untyped-decorator]
    async def keep_redis() -> None:
        try:
            await keep_redis_once()
        except Exception as exc:  # noqa: BLE001 - a timer that raises stops the worker
            logger.warning("keeping Redis failed this tick (next in 0.5 s): %r", exc)

    async def keep_redis_once() -> None:
        """Restore what Redis lost, republish changed policies, write the applied marks."""
        if not book.ready.is_set():
            return
        lost = reassigned["flag"] or not await materializer.client.exists(marker)
        recovery = getattr(app.tables, "recovery", None)
        recovering = recovery is not None and recovery.in_recovery
        if lost and not keeper.holding:
            # Every mark stays away until the records already in the partitions are in.
            tps = owned()
            usage_tps = {f: tp for f, tp in tps.items() if f.startswith("usage:")}
            ends = await app.consumer.highwaters(*usage_tps.values())
            keeper.lost(
                {f: ends.get(tp, 0) for f, tp in usage_tps.items()},
                [f for f in tps if f not in usage_tps],
            )
        if lost or book.version != published["version"]:
            await materializer.write_policies(book.policies.values(), topology())
            published["version"] = book.version
        if lost and not recovering:
            restored = 0
            for key, value in list(table.items()):
                await materializer.restore(key, KeyState.from_bytes(value))
                restored += 1
            await materializer.client.set(marker, b"1")
            reassigned["flag"] = False
            logger.info("wrote %d budget windows and the policies into Redis", restored)
            lost = False
        if lost or recovering:
            return
        # Bounded: a broker that does not answer leaves the marks to age into stale.
        await asyncio.wait_for(write_marks(), timeout=5.0)

    async def write_marks() -> None:
        tps = owned()
        complete = await materializer.marks_present(topology().all_usage_marks())
        due = keeper.due(await progress(tps), complete)
        await materializer.write_marks(due, marker)

    drift = DriftCycle()
    #: Keys whose table value is written but whose Redis write is still in flight: Redis
    #: is behind there for a moment, which is not drift.
    writing: set[str] = set()

    @app.timer(interval=1.0)  # type: ignore[untyped-decorator]
    async def drift_check() -> None:
        """Compare a budgeted number of windows with Redis per second; heal differences."""
        if not settings.drift_keys_per_s or not book.ready.is_set():
            return
        recovery = getattr(app.tables, "recovery", None)
        if recovery is not None and recovery.in_recovery:
            return
        now_ms = int(time.time() * 1000)
        for key in drift.next_keys(table, settings.drift_keys_per_s):
            if key in writing:
                continue
            state = KeyState.from_bytes(table.get(key))
            if not state.bucket_ms or not windows_live(state, now_ms):
                continue  # nothing left in the window: Redis may have let it expire
            if await materializer.heal(key, state):
                metrics.DRIFT_KEYS.inc()
                logger.warning("budget window %s differed in Redis from the table: healed", key)

    @app.timer(interval=5.0)  # type: ignore[untyped-decorator]
    async def dedupe_figures() -> None:
        metrics.DEDUPE_IDS.set(ids.size())

    split_positions, account_positions = Positions(), Positions()

    @app.on_partitions_assigned.connect
    def forget_positions(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # After a rebalance each partition starts again from the group's committed offset.
        split_positions.forget()
        account_positions.forget()
        handled.clear()
        # Partitions may be new here: their windows are rewritten from the table (after
        # its recovery) and vouched for only once caught up, as after a loss of Redis.
        reassigned["flag"] = True

    async def skipped(positions: Positions, topic: str, partition: int, offset: int) -> list[Any]:
        """Records of this partition the stream skipped before ``offset`` (read back)."""
        last = positions.last(partition)
        tp = TopicPartition(topic, partition)
        committed = (
            await committed_offset(settings.kafka_bootstrap, settings.app_id, tp)
            if last is None
            else None
        )
        wanted = missing_range(last, committed, offset)
        if not wanted:
            return []
        records = await read_range(settings.kafka_bootstrap, tp, wanted)
        logger.warning(
            "%s[%d]: the stream skipped offsets %d..%d; handling %d records read back first",
            topic,
            partition,
            wanted.start,
            wanted.stop - 1,
            len(records),
        )
        metrics.REFILLED.labels(topic=topic).inc(len(records))
        return records

    def done(msg: Any, broker_ms: int) -> None:
        """``msg`` is handled, its effects written (the applied marks, streams.marks)."""
        handled[(msg.topic, msg.partition)] = (msg.offset + 1, broker_ms)

    async def split_one(raw: bytes, msg: Any, broker_ms: int) -> None:
        pos = Position(msg.partition, msg.offset, broker_ms)
        metrics.OFFSET.labels(topic=msg.topic, partition=str(msg.partition)).set(msg.offset)
        track_policies()
        if ids.covered(pos.partition) < pos.offset - 1:
            # First record of a partition this worker did not process up to here.
            await rebuild_ids(settings.kafka_bootstrap, msg.topic, ids, pos)
        out = fan_out(
            raw,
            broker_ms=broker_ms,
            policies=book.policies.values(),
            prices=prices,
            max_future_skew_ms=settings.max_future_skew_ms,
            src=pos,
            ids=ids,
        )
        ids.advance(pos)
        split_positions.handled(msg.partition, msg.offset)
        for reason in [out.rejected] if out.rejected else out.partial:
            await dead_letter_raw(reason, raw, msg)
        if out.rejected:
            metrics.EVENTS.labels(kind="invalid", outcome="dead_lettered").inc()
            return
        if out.duplicate:
            metrics.DUPLICATES.inc()
            metrics.EVENTS.labels(kind=out.kind, outcome="duplicate").inc()
            return
        metrics.EVENTS.labels(kind=out.kind, outcome="counted").inc()
        if out.clamped:
            metrics.CLAMPED.inc()
        for rec in out.records:
            await keyed.send(key=rec.key, value=replace(rec, broker_ms=broker_ms).to_json())

    async def account_one(value: dict[str, Any], msg: Any) -> None:
        account_positions.handled(msg.partition, msg.offset)
        rec = KeyedRecord.from_json(value)
        state = KeyState.from_bytes(table.get(rec.key))
        change = apply(state, rec)
        due = evaluate(state, rec) if change.outcome == "applied" else []
        if change.outcome != "redelivery":
            encoded = state.to_bytes()
            if len(encoded) > settings.max_value_bytes:
                # Written, this value would exceed the changelog's message limit and stop
                # the worker for good: the record is refused instead.
                metrics.OUTCOMES.labels(outcome="too_large").inc()
                metrics.UNWRITABLE.inc()
                await dead_letter_raw(
                    f"budget key {rec.key}: its state would be {len(encoded)} bytes, over "
                    f"max_value_bytes {settings.max_value_bytes}; the record was not "
                    f"applied (narrow the policy's window or widen its bucket)",
                    orjson.dumps(value),
                    msg,
                )
                return
            table[rec.key] = encoded
        metrics.OUTCOMES.labels(outcome=change.outcome).inc()
        writing.add(rec.key)
        try:
            await materializer.write(rec.key, state, change, rec.spec)
        finally:
            writing.discard(rec.key)
        if rec.broker_ms:
            metrics.LAG.observe(max(0.0, time.time() - rec.broker_ms / 1000))
        # Alerts leave only after the state change is in the table and in Redis.
        for alert in due:
            metrics.ALERTS.labels(kind=alert.kind).inc()
            await alerts_topic.send(key=rec.key, value=alert.model_dump_json().encode())

    @app.agent(usage, concurrency=1)
    async def split(stream: faust.StreamT[bytes]) -> None:
        if not book.ready.is_set():
            await book.ready.wait()
        async for event in stream.events():
            msg = event.message
            for back in await skipped(split_positions, msg.topic, msg.partition, msg.offset):
                await split_one(back.value or b"", back, back.timestamp)
                done(back, back.timestamp)
            broker_ms = int(msg.timestamp * 1000)
            await split_one(event.value, msg, broker_ms)
            done(msg, broker_ms)

    @app.agent(keyed, concurrency=1)
    async def account(stream: faust.StreamT[dict[str, Any]]) -> None:
        async for event in stream.events():
            msg = event.message
            for back in await skipped(account_positions, msg.topic, msg.partition, msg.offset):
                # Table writes go to the current event's changelog partition: the same one.
                value = orjson.loads(back.value or b"{}")
                await account_one(value, back)
                done(back, value.get("broker_ms", 0))
            await account_one(event.value, msg)
            done(msg, event.value.get("broker_ms", 0))

    return app


class DriftCycle:
    """Walks every key of the table, a few per tick, and times each full pass."""

    def __init__(self) -> None:
        self._keys: Iterator[str] | None = None
        self._started = time.monotonic()

    def next_keys(self, table: Any, budget: int) -> list[str]:
        """Up to ``budget`` keys after the ones already visited in this cycle."""
        if self._keys is None:
            self._keys, self._started = iter(list(table.keys())), time.monotonic()
        out = list(itertools.islice(self._keys, budget))
        if len(out) < budget:
            metrics.DRIFT_CYCLE.set(time.monotonic() - self._started)
            metrics.DRIFT_CYCLE_END.set(time.time())
            self._keys = None
        return out


def windows_live(state: KeyState, now_ms: int) -> bool:
    """Whether any bucket of ``state`` still counts in its window at ``now_ms``."""
    first = now_ms - state.window_ms - state.bucket_ms
    return any(start >= first for start in state.buckets)


def horizon_ms(settings: WorkerSettings, policies: Iterable[Policy]) -> int:
    """The dedupe horizon in force with ``policies``."""
    return settings.horizon_ms(max((p.window_ms for p in policies), default=0))
