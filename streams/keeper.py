"""Keeping Redis true for the partitions this worker owns: claims, restores, marks.

Every 0.5 s, and at once after an assignment or a loss of Redis data, :class:`RedisKeeper`
claims the owned partitions (a fencing token each), publishes the policies, rewrites the
windows of partitions new to this worker from the table, and advances the marks of the
caught-up partitions (``streams.marks``); the batch commit (``streams.commit``) advances
the others' marks through :meth:`RedisKeeper.advance`, and notes them through
:meth:`RedisKeeper.advanced` once Redis has the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from spendgate.schemas.shards import Topology, keyed_mark, usage_mark
from spendgate.streams import metrics
from spendgate.streams.commit import Last
from spendgate.streams.faust_io import table_items
from spendgate.streams.health import WorkerHealth
from spendgate.streams.kafka_util import OffsetReader
from spendgate.streams.ledger import KeyState
from spendgate.streams.marks import Watermarks
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.policybook import PolicyBook
from spendgate.streams.retry import StoreRetry, store_fault
from spendgate.streams.scripts.mark import MarkReply, MarkWrite
from spendgate.streams.settings import WorkerSettings

__all__ = ["TRIP_TIMEOUT_S", "RedisKeeper"]

logger = logging.getLogger(__name__)

#: The longest one step of keeping Redis may wait for Redis or the broker.
TRIP_TIMEOUT_S = 10.0


class RedisKeeper:
    """The marks bookkeeping of one worker: what it claimed, applied and must restore.

    Args:
        app: the faust app (its consumer: assignment, committed offsets, generation).
        settings: the worker's settings.
        book: the policies in force.
        materializer: Redis.
        table: the key-state table (restores read it).
        health: kept current with the owned partitions' states.
    """

    def __init__(
        self,
        app: Any,
        settings: WorkerSettings,
        book: PolicyBook,
        materializer: RedisMaterializer,
        table: Any,
        health: WorkerHealth,
    ) -> None:
        self.app = app
        self.settings = settings
        self.book = book
        self.materializer = materializer
        self.table = table
        self.health = health
        # This worker's presence in Redis (set when it claims its partitions): when it is
        # gone, Redis lost its data (flush, restart without persistence) and the worker
        # claims its partitions again and rewrites everything it owns from its table.
        self.presence = f"{settings.redis_prefix}worker:{uuid.uuid4().hex}"
        self.watermarks = Watermarks(settings.mark_clock_skew_ms)
        #: A claim is due (an assignment: claim every field again); Redis lost its data;
        #: how many claims were asked for (one asked meanwhile is made next tick).
        self.claim_due, self.lost, self.asked = True, False, 0
        self.claimed: set[str] = set()
        self.last_tps: dict[str, Any] = {}
        #: The group generation of the last claim, and of the last table recovery completed.
        self.generation: int | None = None
        self.recovered: int | None = None
        self.published_version = -1
        self.wake = asyncio.Event()
        # Offsets asked of the broker directly: faust's own calls pass through its consumer
        # thread and take a second or more each.
        self.offsets = OffsetReader(settings.kafka())
        #: (topic, partition) -> next offset to handle (last handled + 1).
        self.handled: dict[tuple[str, int], int] = {}
        #: Its Redis errors: counted, logged, the next tick after the backoff.
        self.retry = StoreRetry("keep_redis")

    # -- what faust tells it --------------------------------------------------------------

    def on_assigned(self) -> None:
        """Every owned partition is claimed again (a new fencing token); those new to this
        worker have their windows rewritten from the table first (``streams.marks``)."""
        self.claim_due = True
        self.asked += 1
        self.wake.set()

    def on_recovered(self) -> None:
        """The tables are recovered for this generation: restores may start."""
        self.recovered = getattr(self.app, "consumer_generation_id", None)
        self.wake.set()

    async def close(self) -> None:
        """Close the offset reader."""
        await self.offsets.close()

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Claim, restore, sample and advance the idle marks: every 0.5 s, and at once
        after an assignment or a loss of Redis data."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=0.5)
            self.wake.clear()
            if not self.book.ready.is_set():
                continue
            await self.retry.wait()
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - the loop must go on
                if store_fault(exc):
                    self.retry.failed(exc)
                else:
                    logger.warning("keeping Redis failed this tick (next in 0.5 s): %r", exc)
            else:
                self.retry.succeeded()

    async def tick(self) -> None:
        """One round: claim and publish, restore, advance the idle marks."""
        # Each step bounded: a broker or Redis that does not answer leaves the marks to
        # age. A restore takes as long as the table is large, each trip bounded.
        await asyncio.wait_for(self.claim_and_publish(), timeout=TRIP_TIMEOUT_S)
        await self.restore_moved()
        await asyncio.wait_for(self.advance_idle(), timeout=TRIP_TIMEOUT_S)

    # -- partitions -----------------------------------------------------------------------

    def topology(self) -> Topology:
        """The usage and keyed topics' partition counts as the consumer sees them."""
        parts = self.app.consumer.topic_partitions
        return Topology(
            usage=parts(self.settings.topic("usage")) or self.settings.partitions,
            keyed=parts(self.settings.keyed_topic) or self.settings.partitions,
        )

    def field_of(self, topic: str, partition: int) -> str | None:
        """The mark field of a usage or keyed partition (None: another topic)."""
        if topic == self.settings.topic("usage"):
            return usage_mark(partition)
        if topic == self.settings.keyed_topic:
            return keyed_mark(partition)
        return None

    def owned(self) -> dict[str, Any]:
        """Mark field -> topic partition, for every usage and keyed partition owned."""
        out: dict[str, Any] = {}
        for tp in self.app.consumer.assignment():
            if (field := self.field_of(tp.topic, tp.partition)) is not None:
                out[field] = tp
        return out

    def position_of(self, field: str, tp: Any) -> int | None:
        """The next offset to apply: the greatest of what this worker handled, what the
        group committed and what the last owner wrote with its mark (all of it is in
        Redis)."""
        mine = self.handled.get((tp.topic, tp.partition))
        committed = getattr(self.app.consumer, "_committed_offset", {}).get(tp)
        known = [p for p in (mine, committed, self.watermarks.position(field)) if p is not None]
        return max(known) if known else None

    # -- the steps ------------------------------------------------------------------------

    async def claim_and_publish(self) -> None:
        """Claim every owned partition after an assignment or a loss; publish policies."""
        tps = self.owned()
        if tps:
            self.last_tps = dict(tps)
        if self.claim_due or self.lost:
            fields = sorted(tps)
            lost = self.lost
            # A generation skipped (this worker left the group and came back) may have
            # given any partition to another worker meanwhile: all of them count as moved.
            gen = getattr(self.app, "consumer_generation_id", None)
            last = self.generation
            skipped = gen is None or last is None or gen != last + 1
            moved = set(fields) if lost or skipped else set(fields) - self.claimed
            asked = self.asked
            claims = await self.materializer.claim(fields, self.presence, gen)
            # Asked again meanwhile (another assignment, another loss): claimed again next.
            self.claim_due, self.lost = self.asked != asked, self.lost and not lost
            self.watermarks.assign(claims, moved)
            self.claimed = set(fields)
            self.generation = gen
            if lost:
                self.published_version = -1
            logger.info(
                "claimed %d partitions (%d to restore)%s",
                len(fields),
                len(moved),
                " after Redis lost its data" if lost else "",
            )
        if self.book.version != self.published_version:
            await self.materializer.write_policies(self.book.policies.values(), self.topology())
            self.published_version = self.book.version

    async def restore_moved(self) -> None:
        """Rewrite the windows of the partitions new to this worker, once faust has
        recovered their table partitions for the generation they were claimed in."""
        todo = self.watermarks.restoring()
        if todo and self.recovered == self.generation:
            started = time.monotonic()
            n = await self.restore_partitions({int(f.partition(":")[2]) for f in todo})
            self.watermarks.restored(todo)
            metrics.RESTORE_SECONDS.observe(time.monotonic() - started)
            logger.info(
                "restored %d budget windows of %s in %.3f s",
                n,
                sorted(todo),
                time.monotonic() - started,
            )

    async def restore_partitions(self, partitions: set[int]) -> int:
        """Rewrite the windows of ``partitions`` from the table, never over a newer one."""
        items = table_items(self.table, partitions)
        states = ((key, KeyState.from_bytes(v)) for key, v in items)
        return await self.materializer.restore(states, TRIP_TIMEOUT_S)

    async def advance_idle(self) -> None:
        """Sample the usage marks, and advance the marks of the caught-up partitions."""
        tps = self.owned()
        # The clock first, then the end offsets (streams.marks: the idle claim).
        now_ms, usage_marks = await self.materializer.sample(self.topology().all_usage_marks())
        self.watermarks.sample(now_ms, usage_marks)
        # Mid-rebalance the consumer owns nothing for a moment: the partitions of the last
        # claim keep their marks moving until the next claim (a newer owner's token fences
        # them; what they claim is true whoever owns the partition).
        tokens = self.watermarks.owned()
        idle_tps = {f: tp for f, tp in (tps or self.last_tps).items() if f in tokens}
        if idle_tps:
            writes = await self._idle_marks(now_ms, idle_tps)
            self.noted(await self.materializer.write_marks(writes, self.presence))
        staleness_ms = int(self.settings.staleness_s * 1000)
        # Assigned: in the group (faust's generation is 0 until the first join) and not
        # mid-rebalance. A worker given no partition is then ready: it owns nothing to
        # vouch for, and a rollout gated on its readiness must not wait for a rebalance.
        generation = getattr(self.app, "consumer_generation_id", 0) or None
        self.health.update(
            self.watermarks.health(now_ms, staleness_ms),
            assigned=generation is not None and not getattr(self.app, "rebalancing", False),
            generation=generation,
        )

    async def _idle_marks(self, now_ms: int, tps: dict[str, Any]) -> list[MarkWrite]:
        """The idle marks of ``tps`` (field -> topic partition) at Redis time ``now_ms``."""
        ends = await self.offsets.ends(tps.values())
        # A partition new to this worker has no position until its table is recovered
        # and faust has sought to its committed offset; one it kept has its committed
        # offset all along, so its mark advances even while the others recover.
        fresh = self.watermarks.restoring()
        positions = {f: None if f in fresh else self.position_of(f, tp) for f, tp in tps.items()}
        unknown = [tps[f] for f, p in positions.items() if p is None and f not in fresh]
        if unknown:
            # Never committed: the group starts at the log start (auto_offset_reset).
            starts = await self.offsets.starts(unknown)
            positions.update({f: starts.get(tp) for f, tp in tps.items() if tp in starts})
        tokens = self.watermarks.owned()
        writes = []
        for field, tp in tps.items():
            end, position = ends.get(tp), positions[field]
            if end is None or field not in tokens:
                continue
            w = self.watermarks.idle(field, now_ms, end, position)
            behind = None if position is None else max(0, end - position)
            writes.append(MarkWrite(field, tokens[field], w, behind, position))
        return writes

    # -- the batch commit's side (streams.commit.MarkKeeper) ------------------------------

    def advance(self, lasts: Iterable[Last]) -> list[MarkWrite]:
        """The marks a batch that applied up to each of ``lasts`` advances, computed only:
        nothing is noted until Redis has the batch (:meth:`advanced`), so a batch whose
        Redis step failed leaves the positions as they were and the idle marks wait for
        it (they age: admission then refuses, which is safe)."""
        tokens, restoring = self.watermarks.owned(), self.watermarks.restoring()
        out = []
        for topic, partition, offset, broker_ms in lasts:
            field = self.field_of(topic, partition)
            if field is None or field not in tokens:
                continue
            w = self.watermarks.would_apply(field, offset + 1, broker_ms)
            # Until its windows are restored, what this worker applied may not all be in
            # Redis (a record in the table the last owner never wrote there).
            position = None if field in restoring else offset + 1
            out.append(MarkWrite(field, tokens[field], w, position=position))
        return out

    def advanced(self, lasts: Iterable[Last], marks: Iterable[MarkWrite]) -> None:
        """Redis has what a batch applied up to each of ``lasts`` (its windows, and its
        keyed batches are acked), and ``marks`` (from :meth:`advance`) were sent with it:
        the positions move, and the claims become the floor of the next ones."""
        sent = {m.field: m for m in marks}
        for topic, partition, offset, _ in lasts:
            self.handled[(topic, partition)] = offset + 1
            field = self.field_of(topic, partition)
            if field is not None and (m := sent.get(field)) is not None:
                self.watermarks.note_applied(field, offset + 1, m.watermark_ms, m.token)

    def noted(self, reply: MarkReply | None) -> None:
        """Act on what the mark script said: a loss of Redis data, fenced writes."""
        if reply is None:
            return
        if not reply.present:
            logger.warning("Redis lost this worker's presence mark: claiming and restoring")
            self.lost = True
            self.asked += 1
            self.wake.set()
        if reply.fenced:
            metrics.MARKS_FENCED.inc(reply.fenced)
            logger.warning("%d mark writes refused: a newer owner holds them", reply.fenced)
