"""The batch commit's parts as faust provides them: its table, its topics, its stream's acks."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import faust
from faust.streams import _current_event

from spendgate.schemas.alerts import Alert
from spendgate.schemas.deadletter import dead_letter
from spendgate.streams.effects import KeyWrite, Refusal
from spendgate.streams.gaps import applied_key, is_budget_key
from spendgate.streams.remote import RemoteBatch
from spendgate.streams.statecache import StateCache
from spendgate.streams.unsent import decode_alerts, encode_alerts, unsent_key

__all__ = ["FaustTable", "StreamAcks", "TopicOutbox", "current_event_of", "table_items"]


class FaustTable:
    """The key-state table (``streams.commit.StateTable``) and its cache of decoded states."""

    def __init__(self, table: Any, states: StateCache) -> None:
        self.table = table
        self.states = states

    def write(
        self, events: Sequence[Any], writes: Sequence[KeyWrite], alerts: Sequence[Alert] = ()
    ) -> None:
        """Write one partition's changed keys, then the last offset they applied
        (``streams.gaps.applied_key``: after them in the same changelog partition, so a
        table restored from it never holds a position ahead of its states), and the
        ``alerts`` they raised beside those kept unsent (``streams.unsent``); ``events``
        are the faust events of that partition (faust writes to the changelog partition
        of the current event)."""
        last = events[-1].message
        with current_event_of(events[-1]):
            for w in writes:
                if w.changed:
                    self.table[w.key] = w.table_value()
            self.table[applied_key(last.topic, last.partition)] = str(last.offset).encode()
            if alerts:
                key = unsent_key(last.topic, last.partition)
                kept = {a.alert_id: a for a in decode_alerts(self.table.get(key))}
                kept.update((a.alert_id, a) for a in alerts)
                self.table[key] = encode_alerts(kept.values())
        # The same step as the table write (no await between): as new as the table.
        self.states.put((w.key, w.state) for w in writes if w.changed)

    def unsent(self, events: Sequence[Any]) -> list[Alert]:
        """The alerts the partition of ``events`` keeps unsent (``streams.unsent``)."""
        last = events[-1].message
        return decode_alerts(self.table.get(unsent_key(last.topic, last.partition)))

    def sent(self, events: Sequence[Any], alert_ids: Iterable[str]) -> None:
        """Keep no more of ``alert_ids`` (acked) for the partition of ``events``."""
        last = events[-1].message
        key = unsent_key(last.topic, last.partition)
        kept = decode_alerts(self.table.get(key))
        if not kept:
            return
        acked = set(alert_ids)
        left = [a for a in kept if a.alert_id not in acked]
        if len(left) < len(kept):
            with current_event_of(events[-1]):
                self.table[key] = encode_alerts(left)

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


#: How long the acks of a batch wait for its changelog writes to leave faust's buffer.
DRAIN_TIMEOUT_S = 30.0


class StreamAcks:
    """Source offsets (``streams.commit.OffsetCommitter``) as acks of one faust stream."""

    def __init__(self, stream: faust.StreamT[Any], drain_timeout_s: float = DRAIN_TIMEOUT_S):
        self.stream = stream
        self.drain_timeout_s = drain_timeout_s

    async def commit(self, events: Sequence[Any]) -> None:
        """Ack ``events`` once the batch's changelog writes have left faust's producer
        buffer: faust commits acked offsets on its interval after flushing its producer,
        but that flush gives up on the buffer after 0.1 s without a send
        (``ProducerBuffer.flush_atmost``), and commits offsets whose changelog writes are
        still queued; a kill then leaves the commit ahead of the changelog
        (``streams.gaps``). Handed to the producer first, the writes are in the flush that
        precedes the commit.

        Raises:
            TimeoutError: the buffer did not drain in ``drain_timeout_s``; nothing acked
                (the records come again).
        """
        await drain(self.stream.app.producer, self.drain_timeout_s)
        for event in events:
            await self.stream.ack(event)


async def drain(producer: Any, timeout_s: float) -> None:
    """Wait until faust's producer buffer has handed every queued message to the producer.

    Raises:
        TimeoutError: still not empty after ``timeout_s``.
    """
    buffer = getattr(producer, "buffer", None)
    if buffer is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while buffer.size:
        if loop.time() > deadline:
            raise TimeoutError(f"faust's producer buffer still holds {buffer.size} messages")
        # Returns after 0.1 s without a send, or once the buffer is empty.
        await buffer.flush_atmost(buffer.size)
    # The last message taken from the queue is handed to the producer in this step.
    await asyncio.sleep(0)


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
    """The decoded (key, value) pairs of the budget keys of ``table`` held in
    ``partitions`` (RocksDB keeps one database per partition; any other store is read
    whole); the applied positions (``streams.gaps``) are left out."""
    store = table.data
    dbs = getattr(store, "_dbs", None)
    if dbs is None or not hasattr(store, "_visible_items"):
        yield from ((k, v) for k, v in table.items() if is_budget_key(k))
        return
    for partition in sorted(partitions):
        db = dbs.get(partition)
        if db is None:
            continue
        for raw_key, raw_value in store._visible_items(db):
            key = store._decode_key(raw_key)
            if is_budget_key(key):
                yield key, store._decode_value(raw_value)
