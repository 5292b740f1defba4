"""The faust application: usage records folded in batches (``streams.fold``).

Each agent takes records in batches (``streams.batching``), folds each partition's records in
memory, writes one table value and one Redis write per touched key, sends what follows
(keyed batches, dead letters, alerts) and waits for the broker's acks, and only then acks
the records. Keys of one tenant are accounted in the usage record's own partition; keys
spanning tenants cross the keyed topic once per key and batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
import weakref
from collections.abc import Awaitable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import faust
import redis.asyncio as aioredis
from aiokafka import TopicPartition
from faust.streams import _current_event

from spendgate.schemas.deadletter import dead_letter
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import load_catalog
from spendgate.schemas.shards import Topology, keyed_mark, usage_mark
from spendgate.streams import metrics
from spendgate.streams.batching import batches
from spendgate.streams.dedupe import IdStore, Position
from spendgate.streams.fold import (
    FoldResult,
    KeyedMessage,
    Refusal,
    Rules,
    UsageRecord,
    fold_keyed,
    fold_usage,
)
from spendgate.streams.gaps import Positions, committed_offset, missing_range, read_range
from spendgate.streams.health import WorkerHealth
from spendgate.streams.id_rebuild import rebuild_ids
from spendgate.streams.kafka_util import OffsetReader
from spendgate.streams.ledger import KeyState
from spendgate.streams.marks import Watermarks
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.policybook import PolicyBook
from spendgate.streams.scripts.mark import MarkReply, MarkWrite
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.statecache import StateCache

logger = logging.getLogger(__name__)


def build_app(
    settings: WorkerSettings,
    policies: dict[str, Policy] | None = None,
    retention_ms: int = -1,
    health: WorkerHealth | None = None,
) -> faust.App:
    """Build the worker's faust app with its topics, table, agents and policy tail.

    ``policies``, read before the app starts, lets the agents begin without waiting for
    the policy tail; the tail then keeps them current. ``retention_ms`` is ``usage``'s
    retention (-1: forever), checked again whenever the policies change. ``health`` is
    kept current with the partitions this worker owns (its readiness endpoint).
    """
    health = health if health is not None else WorkerHealth()
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        store="rocksdb://",
        datadir=str(settings.data_dir),
        topic_partitions=settings.partitions,
        topic_replication_factor=1,
        # A standby copy of each table partition on another worker: a handover then
        # restores from the standby, not from the whole changelog.
        table_standby_replicas=settings.standby_replicas,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        producer_acks=-1,
        producer_linger=0.01,
        producer_max_batch_size=256 * 1024,
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
        value_serializer="raw",
        partitions=settings.partitions,
    )
    dlq = app.topic(settings.topic("dlq"), value_serializer="raw", key_serializer="raw")
    alerts_topic = app.topic(settings.topic("alerts"), value_serializer="raw", key_type=str)
    table = app.Table("keystate", partitions=settings.partitions, key_type=str, value_type=bytes)
    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    book = PolicyBook(settings.kafka_bootstrap, settings.topic("policies"), policies)
    materializer = RedisMaterializer(
        aioredis.Redis.from_url(settings.redis_url),
        settings.redis_prefix,
        limit_of=lambda policy_id: p.limit if (p := book.policies.get(policy_id)) else None,
    )
    published = {"version": -1}
    # This worker's presence in Redis (set when it claims its partitions): when it is gone,
    # Redis lost its data (flush, restart without persistence) and the worker claims its
    # partitions again and rewrites everything it owns from its table (streams.marks).
    marker = f"{settings.redis_prefix}worker:{uuid.uuid4().hex}"
    watermarks = Watermarks(settings.mark_clock_skew_ms)
    #: What changed since the last claim: an assignment (claim every field again), a
    #: loss of Redis data; and the fields and group generation of the last claim.
    claim = {"due": True, "lost": False, "asked": 0}
    claimed: set[str] = set()
    last_tps: dict[str, Any] = {}
    #: The group generation of the last claim, and of the last table recovery completed.
    generation: dict[str, int | None] = {"last": None, "recovered": None}
    wake = asyncio.Event()
    # Offsets asked of the broker directly: faust's own calls pass through its consumer
    # thread and take a second or more each.
    offsets = OffsetReader(settings.kafka_bootstrap)
    #: (topic, partition) -> next offset to handle (last handled + 1).
    handled: dict[tuple[str, int], int] = {}
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

    @app.task  # type: ignore[untyped-decorator]
    async def policy_tail() -> None:
        await book.run()

    def topology() -> Topology:
        parts = app.consumer.topic_partitions
        return Topology(
            usage=parts(settings.topic("usage")) or settings.partitions,
            keyed=parts(settings.keyed_topic) or settings.partitions,
        )

    def field_of(topic: str, partition: int) -> str | None:
        if topic == settings.topic("usage"):
            return usage_mark(partition)
        if topic == settings.keyed_topic:
            return keyed_mark(partition)
        return None

    def owned() -> dict[str, Any]:
        """Mark field -> topic partition, for every usage and keyed partition owned."""
        out: dict[str, Any] = {}
        for tp in app.consumer.assignment():
            if (field := field_of(tp.topic, tp.partition)) is not None:
                out[field] = tp
        return out

    def position_of(field: str, tp: Any) -> int | None:
        """The next offset to apply: the greatest of what this worker handled, what the
        group committed and what the last owner wrote with its mark (all of it is in
        Redis)."""
        mine = handled.get((tp.topic, tp.partition))
        committed = getattr(app.consumer, "_committed_offset", {}).get(tp)
        known = [p for p in (mine, committed, watermarks.position(field)) if p is not None]
        return max(known) if known else None

    @app.task  # type: ignore[untyped-decorator]
    async def keep_redis() -> None:
        """Claim, restore, sample and advance the idle marks: every 0.5 s, and at once
        after an assignment or a loss of Redis data."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=0.5)
            wake.clear()
            if not book.ready.is_set():
                continue
            try:
                # Each step bounded: a broker or Redis that does not answer leaves the marks
                # to age. A restore takes as long as the table is large, each trip bounded.
                await asyncio.wait_for(claim_and_publish(), timeout=TRIP_TIMEOUT_S)
                await restore_moved()
                await asyncio.wait_for(advance_idle(), timeout=TRIP_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the loop must go on
                logger.warning("keeping Redis failed this tick (next in 0.5 s): %r", exc)

    async def claim_and_publish() -> None:
        """Claim every owned partition after an assignment or a loss; publish policies."""
        tps = owned()
        if tps:
            last_tps.clear()
            last_tps.update(tps)
        if claim["due"] or claim["lost"]:
            fields = sorted(tps)
            lost = claim["lost"]
            # A generation skipped (this worker left the group and came back) may have given
            # any partition to another worker meanwhile: all of them count as moved.
            gen = getattr(app, "consumer_generation_id", None)
            skipped = gen is None or generation["last"] is None or gen != generation["last"] + 1
            moved = set(fields) if lost or skipped else set(fields) - claimed
            asked = claim["asked"]
            claims = await materializer.claim(fields, marker)
            # Asked again meanwhile (another assignment, another loss): claimed again next.
            claim["due"], claim["lost"] = claim["asked"] != asked, claim["lost"] and not lost
            watermarks.assign(claims, moved)
            claimed.clear()
            claimed.update(fields)
            generation["last"] = gen
            if lost:
                published["version"] = -1
            logger.info(
                "claimed %d partitions (%d to restore)%s",
                len(fields),
                len(moved),
                " after Redis lost its data" if lost else "",
            )
        if book.version != published["version"]:
            await materializer.write_policies(book.policies.values(), topology())
            published["version"] = book.version

    async def restore_moved() -> None:
        """Rewrite the windows of the partitions new to this worker, once faust has
        recovered their table partitions for the generation they were claimed in."""
        todo = watermarks.restoring()
        if todo and generation["recovered"] == generation["last"]:
            started = time.monotonic()
            n = await restore_partitions({int(f.partition(":")[2]) for f in todo})
            watermarks.restored(todo)
            metrics.RESTORE_SECONDS.observe(time.monotonic() - started)
            logger.info(
                "restored %d budget windows of %s in %.3f s",
                n,
                sorted(todo),
                time.monotonic() - started,
            )

    async def advance_idle() -> None:
        """Sample the usage marks, and advance the marks of the caught-up partitions."""
        tps = owned()
        # The clock first, then the end offsets (streams.marks: the idle claim).
        now_ms, usage_marks = await materializer.sample(topology().all_usage_marks())
        watermarks.sample(now_ms, usage_marks)
        # Mid-rebalance the consumer owns nothing for a moment: the partitions of the last
        # claim keep their marks moving until the next claim (a newer owner's token fences
        # them; what they claim is true whoever owns the partition).
        idle_tps = {f: tp for f, tp in (tps or last_tps).items() if f in watermarks.owned()}
        if idle_tps:
            tps = idle_tps
            ends = await offsets.ends(tps.values())
            # A partition new to this worker has no position until its table is recovered
            # and faust has sought to its committed offset; one it kept has its committed
            # offset all along, so its mark advances even while the others recover.
            fresh = watermarks.restoring()
            positions = {f: None if f in fresh else position_of(f, tp) for f, tp in tps.items()}
            unknown = [tps[f] for f, p in positions.items() if p is None and f not in fresh]
            if unknown:
                # Never committed: the group starts at the log start (auto_offset_reset).
                starts = await offsets.starts(unknown)
                positions.update({f: starts.get(tp) for f, tp in tps.items() if tp in starts})
            tokens = watermarks.owned()
            writes = []
            for field, tp in tps.items():
                end, position = ends.get(tp), positions[field]
                if end is None or field not in tokens:
                    continue
                w = watermarks.idle(field, now_ms, end, position)
                behind = None if position is None else max(0, end - position)
                writes.append(MarkWrite(field, tokens[field], w, behind, position))
            noted(await materializer.write_marks(writes, marker))
        staleness_ms = int(settings.staleness_s * 1000)
        health.update(watermarks.health(now_ms, staleness_ms), assigned=bool(owned()))

    def noted(reply: MarkReply | None) -> None:
        """Act on what the mark script said: a loss of Redis data, fenced writes."""
        if reply is None:
            return
        if not reply.present:
            logger.warning("Redis lost this worker's presence mark: claiming and restoring")
            claim["lost"] = True
            claim["asked"] += 1
            wake.set()
        if reply.fenced:
            metrics.MARKS_FENCED.inc(reply.fenced)
            logger.warning("%d mark writes refused: a newer owner holds them", reply.fenced)

    async def restore_partitions(partitions: set[int]) -> int:
        """Rewrite the windows of ``partitions`` from the table, never over a newer one."""
        states = ((key, KeyState.from_bytes(v)) for key, v in table_items(table, partitions))
        return await materializer.restore(states, TRIP_TIMEOUT_S)

    def advance(lasts: Iterable[tuple[str, int, int, int]]) -> list[MarkWrite]:
        """The marks a batch advances: (topic, partition, last offset, its broker ms)."""
        tokens, restoring = watermarks.owned(), watermarks.restoring()
        out = []
        for topic, partition, offset, broker_ms in lasts:
            handled[(topic, partition)] = offset + 1
            field = field_of(topic, partition)
            if field is None or field not in tokens:
                continue
            w = watermarks.applied(field, offset + 1, broker_ms)
            # Until its windows are restored, what this worker applied may not all be in
            # Redis (a record in the table the last owner never wrote there).
            position = None if field in restoring else offset + 1
            out.append(MarkWrite(field, tokens[field], w, position=position))
        return out

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
        due: list[tuple[str, KeyState]] = []
        for key in drift.next_keys(table, settings.drift_keys_per_s):
            if key in writing:
                continue
            state = KeyState.from_bytes(table.get(key))
            if not state.bucket_ms or not windows_live(state, now_ms):
                continue  # nothing left in the window: Redis may have let it expire
            due.append((key, state))
        for (key, _), healed in zip(due, await materializer.heal_many(due), strict=True):
            if healed:
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
        states.forget()
        # ``handled`` stays: what this worker applied is in Redis whoever owns it now.
        # Every owned partition is claimed again (a new fencing token); those new to this
        # worker have their windows rewritten from the table first (streams.marks).
        claim["due"] = True
        claim["asked"] += 1
        wake.set()

    @app.on_rebalance_complete.connect
    def note_recovered(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # Sent once the tables are recovered for this generation (before the streams
        # resume): the windows of moved partitions can be restored from them now.
        generation["recovered"] = getattr(app, "consumer_generation_id", None)
        wake.set()

    @app.on_before_shutdown.connect
    async def close_offsets(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        await offsets.close()

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

    rules_cache: dict[str, Any] = {"version": None, "rules": None}

    def rules() -> Rules:
        """The fold's rules for the policies in force (rebuilt once per policy version)."""
        if rules_cache["version"] != book.version:
            rules_cache["rules"] = Rules(book.policies.values(), prices)
            rules_cache["version"] = book.version
        rule: Rules = rules_cache["rules"]
        return rule

    states = StateCache(settings.state_cache_items)
    load = states.loader(lambda key: KeyState.from_bytes(table.get(key)))

    def keep(result: FoldResult, events: list[Any]) -> None:
        """Write one partition's fold to the table; ``events`` are the faust events of
        that partition (table writes go to its changelog partition)."""
        # The table value of every key folded here belongs to this partition's changelog:
        # faust writes to the partition of the current event.
        with current_event_of(events[-1]):
            for w in result.writes:
                if w.changed:
                    table[w.key] = w.table_value()
        # The same step as the table write (no await between): as new as the table.
        states.put((w.key, w.state) for w in result.writes if w.changed)
        # Ahead of Redis until this batch's pipeline ran (other partitions of the batch
        # may await first): not drift.
        writing.update(w.key for w in result.writes)

    async def publish(results: list[FoldResult], lasts: list[tuple[str, int, int, int]]) -> None:
        """Write a batch's windows to Redis (one pipeline), then send what follows from
        them, and wait for the broker's acks; advance the marks of ``lasts`` (topic,
        partition, last offset, its broker ms) with the windows, or after the acks when
        the batch sent keyed batches (a usage mark covers them once they are on the
        keyed topic)."""
        due = [w for result in results for w in result.writes if w.redis_due]
        keys = {w.key for result in results for w in result.writes}
        later = any(result.remote for result in results)
        try:
            noted(await materializer.write_batch(due, [] if later else advance(lasts), marker))
        finally:
            writing.difference_update(keys)
        sent = []
        for result in results:
            sent += [await keyed.send(key=b.key, value=b.to_bytes()) for b in result.remote]
            sent += [await dlq.send(value=dead_letter_bytes(r)) for r in result.refusals]
            # Alerts leave only after the state change is in the table and in Redis.
            sent += [
                await alerts_topic.send(key=a.key, value=a.model_dump_json().encode())
                for a in result.alerts
            ]
        # Acked by the broker before the batch's records are: nothing is lost in a crash.
        await asyncio.gather(*sent)
        if later:
            noted(await materializer.write_marks(advance(lasts), marker))
        for result in results:
            count(result)

    names = {"usage": settings.topic("usage"), "keyed": settings.keyed_topic}

    def dead_letter_bytes(r: Refusal) -> bytes:
        letter = dead_letter(
            r.reason,
            r.raw,
            topic=names[r.topic],
            partition=r.partition,
            offset=r.offset,
            at=datetime.now(UTC),
        )
        return letter.model_dump_json().encode()

    def count(result: FoldResult) -> None:
        c = result.counts
        for (kind, outcome), n in c.events.items():
            metrics.EVENTS.labels(kind=kind, outcome=outcome).inc(n)
        for outcome, n in c.outcomes.items():
            metrics.OUTCOMES.labels(outcome=outcome).inc(n)
        metrics.UNWRITABLE.inc(c.outcomes.get("too_large", 0))
        metrics.DUPLICATES.inc(c.duplicates)
        metrics.CLAMPED.inc(c.clamped)
        metrics.DEAD_LETTERED.inc(len(result.refusals))
        for r in result.refusals:
            logger.warning("dead-lettered record at %s/%s: %s", r.partition, r.offset, r.reason)
        for a in result.alerts:
            metrics.ALERTS.labels(kind=a.kind).inc()
            if a.kind == "overage" and a.actual is not None and a.reserved is not None:
                metrics.OVERAGES.labels(policy=a.policy).inc()
                metrics.OVERAGE_AMOUNT.labels(policy=a.policy).inc(a.actual - a.reserved)

    async def fold_usage_batch(events: list[Any]) -> None:
        """Fold one batch of usage records, partition by partition, and write it."""
        track_policies()
        results: list[FoldResult] = []
        lasts: list[UsageRecord] = []
        topic = names["usage"]
        for partition, group in by_partition(events).items():
            first = group[0].message
            back = await skipped(split_positions, first.topic, partition, first.offset)
            records = [
                UsageRecord(b.partition, b.offset, b.timestamp, b.value or b"") for b in back
            ]
            records += [
                UsageRecord(partition, e.message.offset, int(e.message.timestamp * 1000), e.value)
                for e in group
            ]
            if ids.covered(partition) < records[0].offset - 1:
                # First record of a partition this worker did not process up to here.
                head = records[0]
                await rebuild_ids(
                    settings.kafka_bootstrap,
                    first.topic,
                    ids,
                    Position(partition, head.offset, head.broker_ms),
                )
            result = fold_usage(
                records,
                load,
                rules(),
                max_future_skew_ms=settings.max_future_skew_ms,
                max_value_bytes=settings.max_value_bytes,
                ids=ids,
            )
            keep(result, group)
            results.append(result)
            lasts.append(records[-1])
            now = time.time()
            for r in records:
                metrics.LAG.observe(max(0.0, now - r.broker_ms / 1000))
        await publish(results, [(topic, r.partition, r.offset, r.broker_ms) for r in lasts])
        for last in lasts:
            split_positions.handled(last.partition, last.offset)
            metrics.OFFSET.labels(topic=topic, partition=str(last.partition)).set(last.offset)

    async def fold_keyed_batch(events: list[Any]) -> None:
        """Fold one batch of keyed messages (keys spanning tenants), partition by partition."""
        results: list[FoldResult] = []
        lasts: list[tuple[str, int, int, int]] = []
        for partition, group in by_partition(events).items():
            first = group[0].message
            back = await skipped(account_positions, first.topic, partition, first.offset)
            messages = [KeyedMessage(b.partition, b.offset, b.value or b"") for b in back]
            messages += [KeyedMessage(partition, e.message.offset, e.value) for e in group]
            result = fold_keyed(messages, load, max_value_bytes=settings.max_value_bytes)
            keep(result, group)
            results.append(result)
            broker_ms = int(group[-1].message.timestamp * 1000)
            lasts.append((names["keyed"], partition, messages[-1].offset, broker_ms))
        await publish(results, lasts)
        for _, partition, offset, _ in lasts:
            account_positions.handled(partition, offset)

    async def folded(batch: Awaitable[None]) -> None:
        """Run one batch's fold and writes; a failure leaves no half-folded cached state."""
        try:
            await batch
        except BaseException:
            states.forget()
            writing.clear()
            raise

    @app.agent(usage, concurrency=1)
    async def split(stream: faust.StreamT[bytes]) -> None:
        if not book.ready.is_set():
            await book.ready.wait()
        async for events in batches(stream, settings.batch_size, settings.batch_linger_s):
            await folded(fold_usage_batch(events))
            for event in events:
                await stream.ack(event)

    @app.agent(keyed, concurrency=1)
    async def account(stream: faust.StreamT[bytes]) -> None:
        async for events in batches(stream, settings.batch_size, settings.batch_linger_s):
            await folded(fold_keyed_batch(events))
            for event in events:
                await stream.ack(event)

    return app


#: The longest one step of keeping Redis may wait for Redis or the broker.
TRIP_TIMEOUT_S = 10.0


def table_items(table: Any, partitions: set[int]) -> Iterator[tuple[str, bytes]]:
    """The decoded (key, value) pairs of ``table`` held in ``partitions`` (RocksDB keeps
    one database per partition; any other store is read whole)."""
    store = table.data
    dbs = getattr(store, "_dbs", None)
    if dbs is None or not hasattr(store, "_visible_items"):
        yield from table.items()
        return
    for partition in sorted(partitions):
        db = dbs.get(partition)
        if db is None:
            continue
        for raw_key, raw_value in store._visible_items(db):
            yield store._decode_key(raw_key), store._decode_value(raw_value)


def by_partition(events: list[Any]) -> dict[int, list[Any]]:
    """``events`` grouped by partition, each group in arrival (offset) order."""
    out: dict[int, list[Any]] = {}
    for event in events:
        out.setdefault(event.message.partition, []).append(event)
    return out


@contextmanager
def current_event_of(event: Any) -> Iterator[None]:
    """Make ``event`` faust's current event: table writes go to its partition (faust
    picks the changelog partition and the RocksDB partition from the current event)."""
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


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
