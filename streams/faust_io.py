"""The batch commit's parts as faust provides them: its table, its topics, its stream's acks."""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import faust
from faust.streams import _current_event

from spendgate.schemas.alerts import Alert
from spendgate.schemas.deadletter import dead_letter
from spendgate.streams.effects import KeyWrite, Refusal
from spendgate.streams.remote import RemoteBatch
from spendgate.streams.statecache import StateCache

__all__ = ["FaustTable", "StreamAcks", "TopicOutbox", "current_event_of", "table_items"]


class FaustTable:
    """The key-state table (``streams.commit.StateTable``) and its cache of decoded states."""

    def __init__(self, table: Any, states: StateCache) -> None:
        self.table = table
        self.states = states

    def write(self, events: Sequence[Any], writes: Sequence[KeyWrite]) -> None:
        """Write one partition's changed keys; ``events`` are the faust events of that
        partition (faust writes to the changelog partition of the current event)."""
        with current_event_of(events[-1]):
            for w in writes:
                if w.changed:
                    self.table[w.key] = w.table_value()
        # The same step as the table write (no await between): as new as the table.
        self.states.put((w.key, w.state) for w in writes if w.changed)

    def forget(self) -> None:
        """Drop the cached states (a batch failed: no half-folded state stays)."""
        self.states.forget()


class TopicOutbox:
    """What a batch sends (``streams.commit.Outbox``), on faust's topics.

    Args:
        keyed: the keyed topic; ``dlq``: the dead letters; ``alerts``: the alerts.
        names: the topic names by origin (``usage``, ``keyed``), for dead letters.
    """

    def __init__(self, keyed: Any, dlq: Any, alerts: Any, names: dict[str, str]) -> None:
        self._keyed, self._dlq, self._alerts = keyed, dlq, alerts
        self.names = names

    async def keyed(self, batch: RemoteBatch) -> Awaitable[Any]:
        """Send ``batch`` by its key; returns the broker's ack."""
        fut: Awaitable[Any] = await self._keyed.send(key=batch.key, value=batch.to_bytes())
        return fut

    async def dead_letter(self, refusal: Refusal) -> Awaitable[Any]:
        """Send ``refusal``'s dead letter; returns the broker's ack."""
        letter = dead_letter(
            refusal.reason,
            refusal.raw,
            topic=self.names[refusal.topic],
            partition=refusal.partition,
            offset=refusal.offset,
            at=datetime.now(UTC),
        )
        fut: Awaitable[Any] = await self._dlq.send(value=letter.model_dump_json().encode())
        return fut

    async def alert(self, alert: Alert) -> Awaitable[Any]:
        """Send ``alert`` by its key; returns the broker's ack."""
        value = alert.model_dump_json().encode()
        fut: Awaitable[Any] = await self._alerts.send(key=alert.key, value=value)
        return fut


class StreamAcks:
    """Source offsets (``streams.commit.OffsetCommitter``) as acks of one faust stream."""

    def __init__(self, stream: faust.StreamT[Any]) -> None:
        self.stream = stream

    async def commit(self, events: Sequence[Any]) -> None:
        """Ack ``events``: faust commits acked offsets on its interval, its producer (the
        changelog) flushed first."""
        for event in events:
            await self.stream.ack(event)


@contextmanager
def current_event_of(event: Any) -> Iterator[None]:
    """Make ``event`` faust's current event: table writes go to its partition (faust
    picks the changelog partition and the RocksDB partition from the current event)."""
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


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
