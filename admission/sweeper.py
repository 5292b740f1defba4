"""No reservation escapes: unlist acked reserves, republish those left unacknowledged.

The admit script lists every reservation it makes in the unpublished reserves
(``schemas.redis_keys.unpublished_reserves_key``) and keeps what its ``reserve`` event is
rebuilt from in the reservation record. This module is the other half, run in every
admission process:

* the publisher reports each broker ack (``KafkaPublisher.on_acked``); acked reserves are
  removed from the set in batches (one ZREM per batch, never on the admit path);
* every ``interval_s`` a sweep claims, in one script, the entries older than ``grace_s``
  (re-scoring them, so two processes do not both take them), rebuilds each event from its
  record and publishes it through the acked path with the same event id. A copy landing
  twice is harmless: the worker drops a producer duplicate (same tenant and event id)
  within its dedupe horizon, and a reserve arriving after its own commit or release
  charges nothing and only clears its pending entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from spendgate.admission.metrics import RESERVES_REPUBLISHED, RESERVES_UNRECOVERABLE
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.reserves import reserve_event_from_record
from spendgate.admission.scripts import claim_unpublished
from spendgate.admission.scripts.claim_unpublished import ClaimArgs, ClaimReply
from spendgate.schemas.events import ReserveEvent, UsageEvent
from spendgate.schemas.redis_keys import reservation_key, unpublished_reserves_key

logger = logging.getLogger(__name__)

__all__ = ["ACKED_BACKLOG", "SWEEP_BATCH", "ReserveSweeper"]

#: Most entries one claim takes (a sweep claims again while it gets full batches).
SWEEP_BATCH = 1_000
#: Reservation ids per ZREM.
ZREM_CHUNK = 1_000
#: Acked reserves waiting to be unlisted while Redis is unreachable; beyond this the
#: oldest are forgotten (they are only republished once more: harmless).
ACKED_BACKLOG = 100_000
#: After a failed ZREM, wait this long before trying again.
RETRY_S = 0.5

_REDIS_ERRORS = (RedisError, OSError)


class ReserveSweeper:
    """Keeps the unpublished reserves of one Redis prefix in step with the broker's acks.

    Open with ``async with`` (the app's lifespan): a task removes acked reserves, another
    sweeps every ``interval_s``. :meth:`acked` is the publisher's ack listener.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        publisher: UsagePublisher,
        *,
        grace_s: float = 30.0,
        interval_s: float = 5.0,
        batch: int = SWEEP_BATCH,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.publisher = publisher
        self.grace_s = grace_s
        self.interval_s = interval_s
        self.batch = batch
        self._claim = client.register_script(claim_unpublished.SCRIPT.source)
        self._key = unpublished_reserves_key(prefix)
        self._acked: deque[str] = deque(maxlen=ACKED_BACKLOG)
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def acked(self, event: UsageEvent) -> None:
        """Note a broker ack; an acked reserve is unlisted by the next batch."""
        if isinstance(event, ReserveEvent):
            self._acked.append(event.reservation_id)
            self._wakeup.set()

    async def flush_acked(self) -> int:
        """Remove every reserve acked so far from the unpublished set, one ZREM per chunk.

        Returns:
            How many reservation ids were sent to Redis.

        Raises:
            RedisError: Redis did not answer (the ids are kept for the next try).
        """
        sent = 0
        while self._acked:
            chunk = [self._acked.popleft() for _ in range(min(ZREM_CHUNK, len(self._acked)))]
            try:
                await self.client.zrem(self._key, *chunk)
            except BaseException:
                self._acked.extendleft(reversed(chunk))
                raise
            sent += len(chunk)
        return sent

    async def sweep(self) -> int:
        """Republish every reserve unacknowledged for longer than the grace period.

        Returns:
            How many were republished and acked by the broker now. One claimed but not
            acked in time stays listed and is claimed again after another grace period.

        Raises:
            RedisError: Redis did not answer.
        """
        republished = 0
        cutoff: int | None = None
        while True:
            batch = self._room()
            if batch == 0:
                break
            call = ClaimArgs(self._key, int(self.grace_s * 1000), batch, cutoff)
            reply = ClaimReply.decode(await self._claim(keys=call.keys(), args=call.argv()))
            cutoff, claimed = reply.cutoff, list(reply.claimed)
            if not claimed:
                break
            acked, published = await self._republish(claimed)
            republished += acked
            # A batch not fully acked (Kafka down or slow): the rest waits for the next
            # sweep rather than piling into the publisher's buffer.
            if len(claimed) < batch or acked < published:
                break
        if republished:
            logger.info(
                "republished %d reserve events unacknowledged for over %.0f s",
                republished,
                self.grace_s,
            )
        return republished

    def _room(self) -> int:
        """How many reserves one claim may take: at most half of the publisher's free
        buffer slots, so republishing never fills the buffer live admits need."""
        capacity = getattr(self.publisher, "capacity", None)
        if not isinstance(capacity, int):
            return self.batch
        free = capacity - int(getattr(self.publisher, "depth", 0))
        return max(0, min(self.batch, free // 2))

    async def _republish(self, claimed: list[str]) -> tuple[int, int]:
        """Publish the claimed reserves; returns (acked, published)."""
        pipe = self.client.pipeline(transaction=False)
        for rid in claimed:
            pipe.hgetall(reservation_key(self.prefix, rid))
        records = await pipe.execute()
        events: list[ReserveEvent] = []
        gone: list[str] = []
        for rid, record in zip(claimed, records, strict=True):
            event = reserve_event_from_record(rid, record)
            if event is None:
                gone.append(rid)
            else:
                events.append(event)
        if gone:
            RESERVES_UNRECOVERABLE.inc(len(gone))
            logger.error(
                "%d unpublished reserves have no reservation record any more (expired): "
                "the worker never learned of them: %s",
                len(gone),
                " ".join(gone),
            )
            await self.client.zrem(self._key, *gone)
        # Concurrent: the publisher shares its produce batches among them.
        acked = await asyncio.gather(*(self.publisher.publish_acked(e) for e in events))
        count = sum(acked)
        RESERVES_REPUBLISHED.inc(count)
        return count, len(events)

    async def _flush_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self.flush_acked()
            except _REDIS_ERRORS as exc:
                logger.warning("unlisting acked reserves failed (%s); retrying", exc)
                await asyncio.sleep(RETRY_S)
                self._wakeup.set()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except _REDIS_ERRORS as exc:
                logger.warning("sweeping unpublished reserves failed (%s); retrying", exc)

    async def __aenter__(self) -> ReserveSweeper:
        self._wakeup = asyncio.Event()
        if self._acked:
            self._wakeup.set()
        self._tasks = [
            asyncio.create_task(self._flush_loop()),
            asyncio.create_task(self._sweep_loop()),
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.unlist_remaining()

    async def unlist_remaining(self) -> None:
        """Unlist what was acked so far, once, logging (not raising) a Redis failure.

        For shutdown: the lifespan calls it again after the publisher drained.
        """
        try:
            await self.flush_acked()
        except _REDIS_ERRORS as exc:
            # Left listed: republished once more after the grace period (harmless).
            logger.warning(
                "%d acked reserves stay listed as unpublished (%s)", len(self._acked), exc
            )
