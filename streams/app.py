"""The worker: usage records folded in batches (``streams.fold``) and committed in steps.

:func:`build_app` makes the faust app, its topics and table, and one :class:`Worker` that
holds the worker's state; ``streams.agents`` declares faust's agents, timers and signal
handlers, each of which only calls the worker. Each agent takes records in batches
(``streams.batching``) and commits each batch through a ``streams.commit.BatchCommit``:
fold, table writes, changelog, Redis with marks, sends, offsets. Keys of one tenant are
accounted in the usage record's own partition; keys spanning tenants cross the keyed topic
once per key and batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import faust
from aiokafka import TopicPartition

from spendgate.schemas import kafka_connect
from spendgate.schemas.alerts import Alert
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import load_catalog
from spendgate.schemas.redis_connect import async_client, layout_of
from spendgate.streams import metrics
from spendgate.streams.agents import declare_agents
from spendgate.streams.commit import BatchCommit, Carried, Folded, Last, PartitionFold, drop_carried
from spendgate.streams.dedupe import IdStore, Position
from spendgate.streams.drift import DriftCheck
from spendgate.streams.effects import FoldResult
from spendgate.streams.exceptions import KafkaWaitExpired
from spendgate.streams.faust_io import FaustTable, StreamAcks, TopicOutbox
from spendgate.streams.fold import KeyedMessage, UsageRecord, fold_keyed, fold_usage
from spendgate.streams.gaps import (
    Positions,
    applied_offset,
    committed_offset,
    missing_range,
    read_range,
)
from spendgate.streams.health import WorkerHealth
from spendgate.streams.id_rebuild import rebuild_ids
from spendgate.streams.kafka_util import ReadBound
from spendgate.streams.keeper import RedisKeeper
from spendgate.streams.ledger import KeyState
from spendgate.streams.liveness import Liveness
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.policybook import PolicyBook
from spendgate.streams.rules import Rules
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.statecache import StateCache

__all__ = ["Topics", "Worker", "build_app", "horizon_ms"]

logger = logging.getLogger(__name__)


def build_app(
    settings: WorkerSettings,
    policies: dict[str, Policy] | None = None,
    retention_ms: int = -1,
    health: WorkerHealth | None = None,
    liveness: Liveness | None = None,
    bound_hit: Callable[[KafkaWaitExpired], None] | None = None,
) -> faust.App:
    """Build the worker's faust app with its topics, table, agents and policy tail.

    ``policies``, read before the app starts, lets the agents begin without waiting for
    the policy tail; the tail then keeps them current. ``retention_ms`` is ``usage``'s
    retention (-1: forever), checked again whenever the policies change. ``health`` is
    kept current with the partitions this worker owns (its readiness endpoint),
    ``liveness`` with its agents' progress (its liveness endpoint and watchdog);
    ``bound_hit`` is called with each Kafka wait of a batch past its bound.
    """
    app = faust_app(settings)
    if health is None:
        health = WorkerHealth()
    worker = Worker(app, settings, policies, retention_ms, health, liveness, bound_hit)
    declare_agents(app, worker)
    return app


def faust_app(settings: WorkerSettings) -> faust.App:
    """The faust app with the worker's settings (no topics, tables or agents yet)."""
    return kafka_connect.faust_app(
        settings.kafka(),
        settings.app_id,
        store="rocksdb://",
        datadir=str(settings.data_dir),
        topic_partitions=settings.partitions,
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


@dataclass(frozen=True, slots=True)
class Topics:
    """The worker's faust topics: what it reads (usage, keyed) and what it sends."""

    usage: faust.TopicT
    #: Repartitioned by budget key, so each key's state lives in exactly one partition.
    keyed: faust.TopicT
    dlq: faust.TopicT
    alerts: faust.TopicT

    @classmethod
    def declare(cls, app: faust.App, settings: WorkerSettings) -> Topics:
        """Declare the worker's topics on ``app``."""
        n = settings.partitions
        return cls(
            usage=app.topic(
                settings.topic("usage"), value_serializer="raw", key_serializer="raw", partitions=n
            ),
            keyed=app.topic(
                settings.keyed_topic, key_type=str, value_serializer="raw", partitions=n
            ),
            dlq=app.topic(settings.topic("dlq"), value_serializer="raw", key_serializer="raw"),
            alerts=app.topic(settings.topic("alerts"), value_serializer="raw", key_type=str),
        )


class Worker:
    """One worker's state and what its agents, timers and signal handlers do.

    Args:
        app: the faust app (its topics and table are declared here).
        settings: the worker's settings.
        policies: the policies read before the start (None: wait for the policy tail).
        retention_ms: ``usage``'s retention (-1: forever).
        health: kept current with the owned partitions.
        liveness: told of each agent's progress (None: its own, from the settings).
        bound_hit: called with each Kafka wait of a batch past its bound.
    """

    def __init__(
        self,
        app: faust.App,
        settings: WorkerSettings,
        policies: dict[str, Policy] | None,
        retention_ms: int,
        health: WorkerHealth,
        liveness: Liveness | None = None,
        bound_hit: Callable[[KafkaWaitExpired], None] | None = None,
    ) -> None:
        self.app = app
        self.liveness = liveness or Liveness(settings.worker_stall_s, settings.worker_exit_s)
        self.bound_hit = bound_hit
        self.settings = settings
        self.retention_ms = retention_ms
        self.topics = Topics.declare(app, settings)
        self.table = app.Table(
            "keystate",
            partitions=settings.partitions,
            key_type=str,
            value_type=bytes,
            # The changelog is the table's durable copy: acks=all needs this many replicas.
            extra_topic_configs=settings.kafka().topic_configs(),
        )
        self.prices = load_catalog(settings.prices_file) if settings.prices_file else None
        #: The secret subject fields' key ids: policies, records and dead letters carry them.
        self.key_ids = settings.key_ids()
        self.book = PolicyBook(
            settings.kafka(), settings.topic("policies"), policies, key_ids=self.key_ids
        )
        self.materializer = RedisMaterializer(
            async_client(settings.redis()),
            settings.redis_prefix,
            limit_of=lambda policy_id: (
                p.limit if (p := self.book.policies.get(policy_id)) else None
            ),
            layout=layout_of(settings.redis_prefix, settings.redis_cluster),
            policy_of=self.book.policies.get,
        )
        self.keeper = RedisKeeper(app, settings, self.book, self.materializer, self.table, health)
        #: Keys whose table value is written but whose Redis write is still in flight:
        #: Redis is behind there for a moment, which is not drift.
        self.in_flight: set[str] = set()
        #: Per agent: table writes Redis may not have (``BatchCommit.unmirrored``).
        self.unmirrored: dict[str, dict[str, Carried]] = {}
        metrics.CARRIED_WRITES.set_function(self.carried_writes)
        #: Per agent: alerts the broker has not acked yet (``BatchCommit.unsent``).
        self.unsent_alerts: dict[str, dict[str, Alert]] = {}
        metrics.UNSENT_ALERTS.set_function(
            lambda: sum(len(unsent) for unsent in self.unsent_alerts.values())
        )
        self.drift = DriftCheck(
            app,
            self.table,
            self.book,
            self.materializer,
            settings.drift_keys_per_s,
            self.in_flight,
        )
        self.ids = IdStore(
            settings.data_dir / f"{settings.app_id}-ids",
            horizon_ms(settings, self.book.policies.values()),
            settings.dedupe_memory_mb << 20,
        )
        self._horizon_version = self.book.version
        self._rules: tuple[int, Rules] | None = None
        self.states = StateCache(settings.state_cache_items)
        self.load = self.states.loader(lambda key: KeyState.from_bytes(self.table.get(key)))
        self.split_positions, self.account_positions = Positions(), Positions()
        self.names = {"usage": settings.topic("usage"), "keyed": settings.keyed_topic}
        self.outbox = TopicOutbox(
            self.topics.keyed, self.topics.dlq, self.topics.alerts, self.names
        )

    # -- the agents' batch commits --------------------------------------------------------

    def usage_commit(self, stream: faust.StreamT[Any]) -> BatchCommit:
        """The batch commit of the usage agent, acking on ``stream``."""
        return self._commit(self.fold_usage_partition, stream, self.usage_done, "usage")

    def keyed_commit(self, stream: faust.StreamT[Any]) -> BatchCommit:
        """The batch commit of the keyed agent, acking on ``stream``."""
        return self._commit(self.fold_keyed_partition, stream, self.keyed_done, "keyed")

    def _commit(self, fold: PartitionFold, stream: Any, done: Any, agent: str) -> BatchCommit:
        # What a failed batch wrote to the table but maybe not to Redis outlives the
        # commit: faust restarts a crashed agent, which makes a new one.
        return BatchCommit(
            fold,
            FaustTable(self.table, self.states),
            self.materializer,
            self.keeper,
            self.outbox,
            StreamAcks(stream, self.settings.worker_kafka_wait_s),
            in_flight=self.in_flight,
            done=done,
            unmirrored=self.unmirrored.setdefault(agent, {}),
            unsent=self.unsent_alerts.setdefault(agent, {}),
            kafka_wait_s=self.settings.worker_kafka_wait_s,
        )

    async def policies_ready(self) -> None:
        """Wait until the policies in force are known."""
        if not self.book.ready.is_set():
            await self.book.ready.wait()

    async def fold_usage_partition(
        self, partition: int, events: Sequence[Any]
    ) -> tuple[FoldResult, Last]:
        """Fold one partition's usage records of a batch (step 1 of the usage commit)."""
        self.track_policies()
        first = events[0].message
        back = await self.skipped(
            self.split_positions, first.topic, partition, first.offset, "split"
        )
        records = [UsageRecord(b.partition, b.offset, b.timestamp, b.value or b"") for b in back]
        records += [
            UsageRecord(partition, e.message.offset, int(e.message.timestamp * 1000), e.value)
            for e in events
        ]
        if self.ids.covered(partition) < records[0].offset - 1:
            # First record of a partition this worker did not process up to here.
            head = records[0]
            await rebuild_ids(
                self.settings.kafka(),
                first.topic,
                self.ids,
                Position(partition, head.offset, head.broker_ms),
                self.read_bound("split"),
            )
        result = fold_usage(
            records,
            self.load,
            self.rules(),
            max_future_skew_ms=self.settings.max_future_skew_ms,
            max_value_bytes=self.settings.max_value_bytes,
            ids=self.ids,
        )
        now = time.time()
        for r in records:
            metrics.LAG.observe(max(0.0, now - r.broker_ms / 1000))
        last = records[-1]
        return result, Last(self.names["usage"], partition, last.offset, last.broker_ms)

    async def fold_keyed_partition(
        self, partition: int, events: Sequence[Any]
    ) -> tuple[FoldResult, Last]:
        """Fold one partition's keyed messages of a batch (step 1 of the keyed commit)."""
        first = events[0].message
        back = await self.skipped(
            self.account_positions, first.topic, partition, first.offset, "account"
        )
        messages = [KeyedMessage(b.partition, b.offset, b.value or b"") for b in back]
        messages += [KeyedMessage(partition, e.message.offset, e.value) for e in events]
        result = fold_keyed(messages, self.load, max_value_bytes=self.settings.max_value_bytes)
        broker_ms = int(events[-1].message.timestamp * 1000)
        return result, Last(self.names["keyed"], partition, messages[-1].offset, broker_ms)

    def usage_done(self, parts: Sequence[Folded]) -> None:
        """A usage batch is written and sent: count it, note its positions."""
        for part in parts:
            count(part.result)
            self.split_positions.handled(part.partition, part.last.offset)
            metrics.OFFSET.labels(topic=part.last.topic, partition=str(part.partition)).set(
                part.last.offset
            )

    def keyed_done(self, parts: Sequence[Folded]) -> None:
        """A keyed batch is written and sent: count it, note its positions."""
        for part in parts:
            count(part.result)
            self.account_positions.handled(part.partition, part.last.offset)

    def read_bound(self, agent: str) -> ReadBound:
        """The bound on one read back from Kafka by ``agent`` (each batch read is its
        progress)."""
        return ReadBound(self.settings.worker_kafka_wait_s, lambda: self.liveness.progressed(agent))

    async def skipped(
        self, positions: Positions, topic: str, partition: int, offset: int, agent: str
    ) -> list[Any]:
        """Records of this partition the stream skipped before ``offset`` (read back by
        ``agent``).

        On a partition's first batch since an assignment, from the earlier of the group's
        commit and the last offset the table applied (``streams.gaps``: a commit can run
        ahead of the table)."""
        kafka = self.settings.kafka()
        last = positions.last(partition)
        tp = TopicPartition(topic, partition)
        committed = applied = None
        if last is None:
            committed = await committed_offset(
                kafka, self.settings.app_id, tp, self.read_bound(agent)
            )
            applied = applied_offset(self.table, topic, partition)
        wanted = missing_range(last, committed, offset, applied)
        if not wanted:
            return []
        records = await read_range(kafka, tp, wanted, self.read_bound(agent))
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

    # -- policies -------------------------------------------------------------------------

    def rules(self) -> Rules:
        """The fold's rules for the policies in force (rebuilt once per policy version)."""
        if self._rules is None or self._rules[0] != self.book.version:
            rules = Rules(self.book.policies.values(), self.prices, key_ids=self.key_ids)
            self._rules = (self.book.version, rules)
        return self._rules[1]

    def track_policies(self) -> None:
        """Follow a policy change: the dedupe horizon and the retention it needs."""
        if self._horizon_version == self.book.version:
            return
        self._horizon_version = self.book.version
        settings = self.settings
        self.ids.horizon_ms = horizon_ms(settings, self.book.policies.values())
        longest = max((p.window_ms for p in self.book.policies.values()), default=0)
        short = 0 <= self.retention_ms < settings.retention_needed_ms(longest)
        metrics.RETENTION_SHORT.set(int(short))
        if short:
            logger.warning(
                "policies now need %d ms of retention on %s, which keeps %d ms: raise it",
                settings.retention_needed_ms(longest),
                settings.topic("usage"),
                self.retention_ms,
            )

    # -- what faust tells it --------------------------------------------------------------

    def on_assigned(self, assigned: Iterable[Any]) -> None:
        """A rebalance (``assigned``: every topic partition this worker owns now): each
        partition starts again from the group's committed offset; the carried writes of
        partitions gone to another worker are dropped (it restores them from the
        changelog)."""
        self.split_positions.forget()
        self.account_positions.forget()
        self.states.forget()
        tps = list(assigned)
        for agent, carried in self.unmirrored.items():
            topic = self.names[agent]
            owned = {tp.partition for tp in tps if tp.topic == topic}
            if dropped := drop_carried(carried, owned):
                logger.info("dropped %d carried writes of %s partitions gone", dropped, topic)
        # ``keeper.handled`` stays: what this worker applied is in Redis whoever owns it.
        self.keeper.on_assigned()

    def carried_writes(self) -> int:
        """How many table writes are carried to a next Redis step (``/metrics``)."""
        return sum(len(carried) for carried in self.unmirrored.values())

    def dedupe_figures(self) -> None:
        """The dedupe set's size for ``/metrics``."""
        metrics.DEDUPE_IDS.set(self.ids.size())


def count(result: FoldResult) -> None:
    """Count one partition's fold in the worker's metrics."""
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


def horizon_ms(settings: WorkerSettings, policies: Iterable[Policy]) -> int:
    """The dedupe horizon in force with ``policies``."""
    return settings.horizon_ms(max((p.window_ms for p in policies), default=0))
