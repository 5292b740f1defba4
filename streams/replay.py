"""Rebuild every budget key's state from the usage topic, and restore or verify Redis.

The worker's own pure fold (``streams.fold.fold_usage``) runs here straight on aiokafka
batches (no faust), over the topic read from the beginning (or from a timestamp), so the
result is what the worker computes. Every key is folded locally (one process sees every
partition: no keyed hop). Nothing is written until the end: Redis is restored (or
compared, ``verify``) once, and alerts are published only when asked. Stop the workers
before restoring; ``--verify`` only reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from spendgate.schemas import kafka_connect, window_codec
from spendgate.schemas.alerts import Alert
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import load_catalog
from spendgate.schemas.redis_connect import async_client, check, layout_of
from spendgate.schemas.redis_keys import window_key
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.dedupe import IdStore
from spendgate.streams.fold import FoldResult, KeyWrite, Rules, UsageRecord, fold_usage
from spendgate.streams.kafka_util import assign, partitions, stop
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.policybook import read_policies
from spendgate.streams.settings import WorkerSettings

Progress = Callable[[int, int], None]

#: Keys written (or compared) per Redis round trip.
RESTORE_BATCH = 1000


@dataclass
class ReplaySummary:
    """What a replay read, rebuilt and found."""

    records: int = 0
    dead_lettered: int = 0
    clamped: int = 0
    #: Producer duplicates within the dedupe horizon (counted once).
    duplicates: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    keys: int = 0
    alerts: list[Alert] = field(default_factory=list)
    #: Budget keys whose Redis window differs from the rebuilt one (``verify``).
    differences: list[str] = field(default_factory=list)


@dataclass
class Rebuilt:
    """The rebuilt state of every budget key, its window and the reservations it absorbed."""

    states: dict[str, KeyState] = field(default_factory=dict)
    specs: dict[str, WindowSpec] = field(default_factory=dict)
    absorbed: dict[str, set[str]] = field(default_factory=dict)

    def load(self, key: str) -> KeyState:
        """A key's state so far (the fold's ``load``)."""
        return self.states.get(key) or KeyState()

    def write(self, key: str) -> KeyWrite:
        """One key's rebuilt window for Redis, with every reservation it absorbed."""
        return KeyWrite(
            key,
            self.states[key],
            self.specs[key],
            changed=True,
            window_changed=True,
            absorbed=dict.fromkeys(sorted(self.absorbed.get(key, ()))),
        )

    def take(self, result: FoldResult, summary: ReplaySummary) -> None:
        """Keep one fold batch's effects."""
        for write in result.writes:
            self.states[write.key] = write.state
            self.specs[write.key] = write.spec
            if write.absorbed:
                self.absorbed.setdefault(write.key, set()).update(write.absorbed)
        counts = result.counts
        summary.dead_lettered += len(result.refusals)
        summary.clamped += counts.clamped
        summary.duplicates += counts.duplicates
        for outcome, n in counts.outcomes.items():
            summary.outcomes[outcome] = summary.outcomes.get(outcome, 0) + n
        summary.alerts += result.alerts


async def _read(
    settings: WorkerSettings,
    since: datetime | None,
    rebuilt: Rebuilt,
    summary: ReplaySummary,
    progress: Progress | None,
) -> dict[str, Policy]:
    key_ids = settings.key_ids()
    kafka = settings.kafka()
    policies = await read_policies(kafka, settings.topic("policies"), key_ids=key_ids)
    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    rules = Rules(policies.values(), prices, local=lambda policy: True, key_ids=key_ids)
    longest = max((p.window_ms for p in policies.values()), default=0)
    # The same id set as the worker, in a temporary folder: duplicates count as they did live.
    ids = IdStore(None, settings.horizon_ms(longest), settings.dedupe_memory_mb << 20)
    consumer = kafka_connect.consumer(kafka, enable_auto_commit=False, max_poll_records=2000)
    await consumer.start()
    try:
        tps = await partitions(consumer, settings.topic("usage"))
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        start = {tp: 0 for tp in tps}
        if since is not None:
            found = await consumer.offsets_for_times(
                {tp: int(since.timestamp() * 1000) for tp in tps}
            )
            start = {tp: (found[tp].offset if found[tp] else end[tp]) for tp in tps}
        for tp in tps:
            consumer.seek(tp, start[tp])
        total = sum(end[tp] - start[tp] for tp in tps)
        remaining = {tp for tp in tps if start[tp] < end[tp]}
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=1000)
            records: list[UsageRecord] = []
            for tp, messages in batch.items():
                records += [
                    UsageRecord(m.partition, m.offset, m.timestamp, m.value or b"")
                    for m in messages
                    if m.offset < end[tp]
                ]
                if messages and messages[-1].offset + 1 >= end[tp]:
                    remaining.discard(tp)
            summary.records += len(records)
            result = fold_usage(
                records,
                rebuilt.load,
                rules,
                max_future_skew_ms=settings.max_future_skew_ms,
                max_value_bytes=settings.max_value_bytes,
                ids=ids,
            )
            rebuilt.take(result, summary)
            if progress is not None:
                progress(summary.records, total)
    finally:
        await stop(consumer)
        ids.close()
    return policies


async def replay(
    settings: WorkerSettings,
    *,
    since: datetime | None = None,
    verify: bool = False,
    emit_alerts: bool = False,
    progress: Progress | None = None,
) -> ReplaySummary:
    """Rebuild all key states from the usage topic; write them to Redis or compare.

    Args:
        settings: where the topics and Redis are.
        since: read from the first record at or after this time (default: the beginning).
        verify: compare with Redis instead of writing; differences are listed.
        emit_alerts: publish the rebuilt alerts again (same deterministic ids).
        progress: called with (records read, records to read).
    """
    rebuilt, summary = Rebuilt(), ReplaySummary()
    policies = await _read(settings, since, rebuilt, summary, progress)
    summary.keys = len(rebuilt.states)
    redis = settings.redis()
    client = async_client(redis)
    materializer = RedisMaterializer(
        client,
        settings.redis_prefix,
        limit_of=lambda policy_id: p.limit if (p := policies.get(policy_id)) else None,
        layout=layout_of(settings.redis_prefix, settings.redis_cluster),
        policy_of=policies.get,
    )
    try:
        await check(client, redis)
        keys = sorted(rebuilt.states)
        for start in range(0, len(keys), RESTORE_BATCH):
            chunk = keys[start : start + RESTORE_BATCH]
            if not verify:
                await materializer.write_batch([rebuilt.write(key) for key in chunk])
                continue
            names = [window_key(materializer.shard_of(k), k) for k in chunk]
            if settings.redis_cluster:  # grouped by slot, one pipeline per node
                lives = await client.mget_nonatomic(names)  # type: ignore[attr-defined]
            else:
                lives = await client.mget(names)
            for key, live in zip(chunk, lives, strict=True):
                have = window_codec.read(live if isinstance(live, bytes) else None, None)
                if have != rebuilt.states[key].buckets:
                    summary.differences.append(key)
        if not verify:
            await materializer.write_policies(policies.values())
    finally:
        await client.aclose()
    if emit_alerts and summary.alerts:
        async with kafka_connect.producer(
            settings.kafka(), acks="all", enable_idempotence=True
        ) as producer:
            for alert in summary.alerts:
                await producer.send(
                    settings.topic("alerts"),
                    alert.model_dump_json().encode(),
                    key=alert.key.encode(),
                )
    return summary


def run_replay(
    settings: WorkerSettings,
    *,
    since: datetime | None = None,
    verify: bool = False,
    emit_alerts: bool = False,
    progress: Progress | None = None,
) -> ReplaySummary:
    """Synchronous wrapper of :func:`replay` for the CLI."""
    return asyncio.run(
        replay(settings, since=since, verify=verify, emit_alerts=emit_alerts, progress=progress)
    )
