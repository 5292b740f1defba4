"""One bounded outbound producer: a buffer drained to Kafka by a sender woken by an event.

Modelled on aiokafka's ``MessageAccumulator``: items join a bounded buffer without
waiting (``_accept`` is O(1) and never blocks: the admit path calls it), a background
sender sleeps on an :class:`asyncio.Event` until something is queued (then lingers, when a
linger is set, so what arrives meanwhile goes out together), and :meth:`flush` awaits the
settlement of exactly what was accepted before it was called, woken by the callbacks that
settle each item rather than polling. An item counts against the bound from the moment it
is accepted until it is settled (acked, or given up by the subclass); a subclass that
retries puts an item back at the head of the buffer with ``_requeue``.

The producer is (re)started by the sender, so the service starts and answers while Kafka
is down. Subclasses say how a pass sends (``_send_queued``), how a send is settled, and
what is reported at shutdown: :class:`~spendgate.admission.publisher.KafkaPublisher`
(usage events, retried until acked) and :class:`~spendgate.admission.refusals.KafkaRefusals`
(refusals, batched per partition, dropped and counted on failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from aiokafka import AIOKafkaProducer

from spendgate.schemas import kafka_connect
from spendgate.schemas.kafka_connect import KafkaConnection

__all__ = ["BoundedProducer", "start_producer"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: At most one "buffer is full" warning per producer in this many seconds.
FULL_LOG_EVERY_S = 10.0


async def start_producer(
    what: str, retry_s: float, kafka: KafkaConnection, **options: Any
) -> AIOKafkaProducer:
    """Start an aiokafka producer on ``kafka`` with ``options``, retrying every ``retry_s``
    until it starts (the service answers meanwhile); a cancelled start stops what it began."""
    while True:
        producer = kafka_connect.producer(kafka, **options)
        try:
            await producer.start()
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await producer.stop()
            raise
        except Exception as exc:  # noqa: BLE001 - any start failure: retry later
            logger.warning("%s cannot start (%s); retrying", what, exc)
            with contextlib.suppress(Exception):
                await producer.stop()
            await asyncio.sleep(retry_s)
            continue
        return producer


@dataclass(eq=False)
class _Flush:
    """One :meth:`BoundedProducer.flush` call: what it waits for and how much is left."""

    upto: int
    """The sequence number of the last item accepted before the call."""
    left: int
    """Of the items numbered up to ``upto``, how many are not settled yet."""
    done: asyncio.Future[None]


class BoundedProducer(Generic[T]):
    """A bounded buffer of ``T`` sent to one topic by a background sender.

    Use it as an async context manager: entering starts the sender (which starts the
    producer, retrying), leaving is the subclass's (it calls :meth:`_close`).

    Args:
        what: the producer's name in logs.
        kafka: how to reach Kafka.
        topic: the topic sent to.
        capacity: items held at most, queued or in flight; one more is refused.
        retry_s: pause after a failed producer start or a failed pass.
        linger_s: how long the sender lets items gather after it woke (0: none).
        options: passed to :class:`aiokafka.AIOKafkaProducer`.
    """

    def __init__(
        self,
        what: str,
        kafka: KafkaConnection,
        topic: str,
        capacity: int,
        *,
        retry_s: float,
        linger_s: float = 0.0,
        **options: Any,
    ) -> None:
        self.what = what
        self.kafka = kafka
        self.topic = topic
        self.capacity = capacity
        self.retry_s = retry_s
        self.linger_s = linger_s
        self.producer_options = options
        self.producer: AIOKafkaProducer | None = None
        self.connected = False
        self._queue: deque[tuple[int, T]] = deque()
        self._inflight: dict[int, T] = {}
        self._last = -1
        self._flushes: list[_Flush] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._full_logged = -FULL_LOG_EVERY_S

    @property
    def depth(self) -> int:
        """Items accepted and not yet settled (queued or in flight)."""
        return len(self._queue) + len(self._inflight)

    def has_room(self) -> bool:
        """Whether one more item fits in the buffer; when it does not, a warning says so
        (at most one per ``FULL_LOG_EVERY_S``): what is refused or admitted for it is
        counted by the caller, and this line says why."""
        if self.depth < self.capacity:
            return True
        now = time.monotonic()
        if now - self._full_logged >= FULL_LOG_EVERY_S:
            self._full_logged = now
            logger.warning(
                "%s: the buffer is full (%d events not acked by Kafka, connected=%s); "
                "requests are answered by their policy's failure mode until Kafka acks again",
                self.what,
                self.depth,
                self.connected,
            )
        return False

    def _accept(self, item: T) -> bool:
        """Queue ``item`` and wake the sender; False (nothing queued) when full."""
        queue = self._queue
        if len(queue) + len(self._inflight) >= self.capacity:
            return False
        self._last = seq = self._last + 1
        queue.append((seq, item))
        self._wakeup.set()
        return True

    def _take(self, n: int) -> list[tuple[int, T]]:
        """Move up to ``n`` items from the head of the buffer into flight."""
        taken = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
        self._inflight.update(taken)
        return taken

    def _requeue(self, seq: int, item: T) -> None:
        """Put an in-flight item back at the head of the buffer (it is retried), in
        acceptance order among the others put back: a pass that failed as a whole (its
        callbacks run one by one) is sent again in the order it was accepted, so a
        reservation's reserve still reaches Kafka before its commit."""
        self._inflight.pop(seq, None)
        queue = self._queue
        at = 0
        # Only items put back precede newer ones at the head: the scan stops at once
        # past them.
        while at < len(queue) and queue[at][0] < seq:
            at += 1
        queue.insert(at, (seq, item))
        self._wakeup.set()

    def _settle(self, seqs: Iterable[int]) -> None:
        """The items numbered ``seqs`` are done with (acked or given up): out of the
        bound, and every flush waiting for them told."""
        for seq in seqs:
            self._inflight.pop(seq, None)
            for waiting in self._flushes:
                if seq <= waiting.upto:
                    waiting.left -= 1
        if self._flushes:
            for waiting in [w for w in self._flushes if w.left <= 0]:
                self._flushes.remove(waiting)
                if not waiting.done.done():
                    waiting.done.set_result(None)

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every item accepted before this call is settled.

        Items accepted while it waits are not waited for (aiokafka's ``flush`` likewise
        waits for the batches present when it was called).

        Returns:
            True when they all were settled, False when ``timeout_s`` ran out first.
        """
        if not self.depth:
            return True
        waiting = _Flush(self._last, self.depth, asyncio.get_running_loop().create_future())
        self._flushes.append(waiting)
        try:
            await asyncio.wait_for(asyncio.shield(waiting.done), timeout_s)
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._flushes.remove(waiting)
        return True

    async def _start(self) -> AIOKafkaProducer:
        """Start the producer (retrying until it starts)."""
        return await start_producer(self.what, self.retry_s, self.kafka, **self.producer_options)

    async def _send_queued(self, producer: AIOKafkaProducer) -> None:
        """Hand what is queued to ``producer``: one pass of the sender. A subclass takes
        items with ``_take`` and settles them (``_settle``, ``_requeue``) from its futures'
        callbacks; an exception it raises is logged and the pass retried after ``retry_s``."""
        raise NotImplementedError

    async def _run(self) -> None:
        self.producer = producer = await self._start()
        self.connected = True
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.linger_s:
                # Let items gather: one wake-up and one pass, however many arrive meanwhile.
                await asyncio.sleep(self.linger_s)
            try:
                await self._send_queued(producer)
            except Exception as exc:  # noqa: BLE001 - the subclass accounted for the items
                logger.warning("%s: sending failed (%s); retrying", self.what, exc)
                await asyncio.sleep(self.retry_s)

    async def __aenter__(self) -> Self:
        # aiokafka binds to the running loop, so the producer is made in the sender task.
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run())
        return self

    async def _close(self, flush_s: float, stop_s: float | None = None) -> None:
        """Wait up to ``flush_s`` until the buffer is empty, stop the sender, then stop the
        producer within ``stop_s`` (by default what is left of ``flush_s``, at least
        0.5 s: with the broker gone, stopping would otherwise wait out every batch). What
        is still unsettled stays for the subclass to report."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + flush_s
        # Drained, not only flushed: what is accepted while it waits is waited for too.
        while self.depth and (left := deadline - loop.time()) > 0:
            if not await self.flush(left):
                break
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.producer is not None:
            bound = max(0.5, deadline - loop.time()) if stop_s is None else stop_s
            try:
                await asyncio.wait_for(self.producer.stop(), bound)
            except TimeoutError:
                logger.warning("the %s did not stop in time", self.what)
        for waiting in self._flushes:
            waiting.done.cancel()
        self._flushes.clear()
