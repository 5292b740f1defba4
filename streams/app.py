"""The faust application: split usage events per budget key, then account per key."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

import faust
import redis.asyncio as aioredis
from pydantic import ValidationError

from schemas.events import parse_event
from schemas.exceptions import SpendgateError
from schemas.matching import targets
from schemas.prices import load_catalog
from schemas.windows import WindowSpec
from streams import metrics
from streams.ledger import KeyedRecord, KeyState, apply, keyed_record
from streams.materialize import RedisMaterializer
from streams.policybook import PolicyBook
from streams.settings import WorkerSettings

logger = logging.getLogger(__name__)


def dlq_record(reason: str, original: bytes) -> bytes:
    """A dead-letter record: the reason and the original bytes (as text where possible)."""
    return json.dumps(
        {
            "reason": reason,
            "original": original.decode("utf-8", "backslashreplace"),
            "at": datetime.now(UTC).isoformat(),
        }
    ).encode()


def build_app(settings: WorkerSettings) -> faust.App:
    """Build the worker's faust app with its topics, table, agents and policy tail."""
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
    table = app.Table(
        "keystate",
        partitions=settings.partitions,
        key_type=str,
    )
    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    book = PolicyBook(settings.kafka_bootstrap, settings.topic("policies"))
    materializer = RedisMaterializer(
        aioredis.Redis.from_url(settings.redis_url), settings.redis_prefix
    )
    published = {"version": -1}

    def horizon_ms() -> int:
        longest = max((p.window_ms for p in book.policies.values()), default=0)
        return longest + settings.lateness_ms

    async def dead_letter(reason: str, raw: bytes) -> None:
        metrics.DEAD_LETTERED.inc()
        logger.warning("dead-lettered a usage record: %s", reason)
        await dlq.send(value=dlq_record(reason, raw))

    @app.task  # type: ignore[untyped-decorator]
    async def policy_tail() -> None:
        await book.run()

    @app.timer(interval=0.5)  # type: ignore[untyped-decorator]
    async def publish_policies() -> None:
        if book.ready.is_set() and book.version != published["version"]:
            await materializer.write_policies(book.policies.values())
            published["version"] = book.version

    @app.agent(usage, concurrency=1)
    async def split(stream: faust.StreamT[bytes]) -> None:
        await book.ready.wait()
        async for raw in stream:
            try:
                event = parse_event(raw)
                matched = targets(book.policies.values(), event.subject)
            except ValidationError as exc:
                await dead_letter(f"invalid event: {exc.errors(include_url=False)[:3]}", raw)
                continue
            except SpendgateError as exc:
                await dead_letter(str(exc), raw)
                continue
            metrics.EVENTS.labels(kind=event.kind).inc()
            for target in matched:
                try:
                    rec = keyed_record(event, target, horizon_ms(), prices)
                except SpendgateError as exc:
                    await dead_letter(f"policy {target.policy.id}: {exc}", raw)
                    continue
                await keyed.send(key=target.key, value=rec.to_json())

    @app.agent(keyed, concurrency=1)
    async def account(stream: faust.StreamT[dict[str, Any]]) -> None:
        async for value in stream:
            rec = KeyedRecord.from_json(value)
            state = KeyState.from_json(table.get(rec.key))
            change = apply(state, rec)
            metrics.OUTCOMES.labels(outcome=change.outcome).inc()
            if change.outcome != "duplicate":
                table[rec.key] = state.to_json()
            await materializer.write(
                rec.key, state, change, WindowSpec(rec.window_ms, rec.bucket_ms)
            )

    return app
