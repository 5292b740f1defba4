"""Publish usage events to Kafka: reserves queued without waiting, settlements acked."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Protocol

from aiokafka import AIOKafkaProducer

from spendgate.admission.metrics import PUBLISH_BUFFER, PUBLISH_RETRIES, UNPUBLISHED_AT_SHUTDOWN
from spendgate.admission.outbound import BoundedProducer
from spendgate.schemas.events import UsageEvent, partition_key
from spendgate.schemas.kafka_connect import KafkaConnection

logger = logging.getLogger(__name__)

#: Settlement ids remembered as acked, so a retry after a late ack answers at once.
ACKED_MEMORY = 65_536
#: Event ids per log line of the shutdown report (one line per chunk, none cut).
IDS_PER_LINE = 500


class UsagePublisher(Protocol):
    """Where admission sends ``reserve``, ``commit`` and ``release`` events."""

    def has_room(self) -> bool:
        """Whether one more event fits in the buffer."""
        ...

    def publish(self, event: UsageEvent) -> bool:
        """Queue one event without waiting; False when the bounded buffer is full."""
        ...

    async def publish_acked(self, event: UsageEvent) -> bool:
        """Queue one event and wait, within the publisher's bound, until the broker acked it.

        Returns False when no ack came in time: the outcome is unknown (the event stays
        queued and may still land). Calling again with the same ``event_id`` never queues
        a second copy while the first is queued (by either call), in flight or remembered
        as acked.
        """
        ...


class KafkaPublisher(BoundedProducer[UsageEvent]):
    """An idempotent aiokafka producer (``acks=all``) fed from a bounded in-memory buffer.

    ``publish`` never waits: the event joins the buffer and a background task sends it
    (the admit path). ``publish_acked`` joins the same buffer and waits for the broker's
    ack up to ``ack_timeout_s`` (commit and release: their 202 means "in the log").
    Concurrent events share the producer's batches: each is handed to ``send()`` and its
    ack observed on the returned future; nothing flushes per request.

    An event counts against the bound from ``publish`` until the broker acks it; a send
    that fails (broker down, timeout) puts the event back at the head of the buffer and
    is retried with backoff while the process lives. The producer itself is (re)started
    in the background, so the service starts and answers even while Kafka is down. On
    exit the buffer is drained for at most ``shutdown_s``; what is still unacked then is
    logged (count per kind and every event id) and counted in
    ``spendgate_admission_unpublished_at_shutdown_total``.

    ``on_acked``, when set, is called with every event the broker acked (from the ack
    callback: it must not block); the reserve sweeper uses it to unlist acked reserves.
    The buffer, its background sender and ``flush`` are :class:`BoundedProducer`'s.
    """

    def __init__(
        self,
        kafka: KafkaConnection,
        topic: str,
        buffer: int,
        retry_s: float = 0.5,
        *,
        ack_timeout_s: float = 2.0,
        shutdown_s: float = 10.0,
    ) -> None:
        super().__init__(
            "Kafka producer",
            kafka,
            topic,
            buffer,
            retry_s=retry_s,
            enable_idempotence=True,
            acks="all",
            linger_ms=2,
            request_timeout_ms=10_000,
        )
        self.ack_timeout_s = ack_timeout_s
        self.shutdown_s = shutdown_s
        #: event id -> the future its ``publish_acked`` callers wait on.
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._acked: OrderedDict[str, None] = OrderedDict()
        #: event id -> copies queued or in flight (``publish_acked`` joins a held one).
        self._held: dict[str, int] = {}
        self.on_acked: Callable[[UsageEvent], None] | None = None

    def publish(self, event: UsageEvent) -> bool:
        """Queue one event for sending; False when the buffer is full."""
        if not self._accept(event):
            return False
        self._held[event.event_id] = self._held.get(event.event_id, 0) + 1
        PUBLISH_BUFFER.set(self.depth)
        return True

    async def publish_acked(self, event: UsageEvent) -> bool:
        """Queue ``event`` (once per id) and wait up to ``ack_timeout_s`` for its ack.

        Returns:
            True once the broker acked the event (now or earlier), False when the wait
            ran out or the buffer is full (the outcome is then unknown: a retry is safe).
        """
        if event.event_id in self._acked:
            return True
        waiter = self._waiting.get(event.event_id)
        if waiter is None:
            # Already queued or in flight (e.g. a reserve republished while its first copy
            # still waits for the broker): wait for that copy's ack instead.
            if event.event_id not in self._held and not self.publish(event):
                return False
            waiter = asyncio.get_running_loop().create_future()
            self._waiting[event.event_id] = waiter
        try:
            # Shielded: one caller timing out must not cancel the ack others wait for.
            await asyncio.wait_for(asyncio.shield(waiter), self.ack_timeout_s)
        except TimeoutError:
            return False
        return True

    def _acked_ok(self, event: UsageEvent) -> None:
        held = self._held.pop(event.event_id, 1) - 1
        if held > 0:
            self._held[event.event_id] = held
        if self.on_acked is not None:
            try:
                self.on_acked(event)
            except Exception:  # a listener's bug must not lose the ack of its waiters
                logger.exception("the ack listener failed on %s", event.event_id)
        waiter = self._waiting.pop(event.event_id, None)
        if waiter is None:
            return
        if not waiter.done():
            waiter.set_result(None)
        self._acked[event.event_id] = None
        if len(self._acked) > ACKED_MEMORY:
            self._acked.popitem(last=False)

    def _done(self, seq: int, event: UsageEvent, future: asyncio.Future[object]) -> None:
        if future.cancelled() or future.exception() is not None:
            PUBLISH_RETRIES.inc()
            logger.warning("publishing %s failed; will retry", event.event_id)
            self._requeue(seq, event)
        else:
            self._acked_ok(event)
            self._settle((seq,))
        PUBLISH_BUFFER.set(self.depth)

    async def _send_queued(self, producer: AIOKafkaProducer) -> None:
        """Hand every queued event to ``send()`` one by one (the producer batches them);
        its ack is observed on the returned future."""
        while self._queue:
            ((seq, event),) = self._take(1)
            try:
                future = await producer.send(
                    self.topic,
                    event.model_dump_json().encode(),
                    key=partition_key(event.subject),
                )
            except BaseException as exc:
                # Cancelled (shutdown) or refused: the event is still ours to account for.
                self._requeue(seq, event)
                if not isinstance(exc, Exception):
                    raise
                PUBLISH_RETRIES.inc()
                logger.warning("queueing %s failed (%s); retrying", event.event_id, exc)
                await asyncio.sleep(self.retry_s)
                return
            future.add_done_callback(functools.partial(self._done, seq, event))

    def unpublished(self) -> list[UsageEvent]:
        """Events accepted and not (yet) acked: in flight first, then queued."""
        return [*self._inflight.values(), *(event for _, event in self._queue)]

    def _report_unpublished(self) -> None:
        left = self.unpublished()
        if not left:
            logger.info("every accepted event was published before shutdown")
            return
        kinds = Counter(e.kind for e in left)
        for kind, count in kinds.items():
            UNPUBLISHED_AT_SHUTDOWN.labels(kind=kind).inc(count)
        logger.error(
            "%d events were not acknowledged by Kafka before shutdown (%s); none of them was "
            "answered 202; their ids follow",
            len(left),
            ", ".join(f"{kind}={count}" for kind, count in sorted(kinds.items())),
        )
        ids = [e.event_id for e in left]
        for start in range(0, len(ids), IDS_PER_LINE):
            logger.error("unpublished event ids: %s", " ".join(ids[start : start + IDS_PER_LINE]))

    async def __aexit__(self, *exc: object) -> None:
        await self._close(self.shutdown_s)
        for waiter in self._waiting.values():
            waiter.cancel()
        self._report_unpublished()
