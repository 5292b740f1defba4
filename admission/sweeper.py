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

On a Redis Cluster each virtual shard has its own unpublished reserves, swept in turn,
and its own provisional set of pieces (``admission.pieces``): a piece past its deadline
is resolved against its reservation's home shard in one step (TOMBSTONE, acknowledged by a
replica like SEAL): a record found means the reservation was sealed (the piece only
leaves the list), none means it never will be (the tombstone, set in that step, refuses
its seal), and the piece is released. Either order of seal and sweep gives
exactly one of the two, whatever the clocks say, so a sweep too early can only abort a
slow request, never double-count or lose one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from spendgate.admission.metrics import (
    PIECES_SWEPT,
    RESERVES_REPUBLISHED,
    RESERVES_UNRECOVERABLE,
    STORE_ERRORS,
)
from spendgate.admission.pieces import release_args
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.replicated import run_replicated
from spendgate.admission.reserves import IDEMPOTENCY_TTL_MS, reserve_event_from_record
from spendgate.admission.scripts import claim_unpublished, tombstone
from spendgate.admission.scripts.claim_unpublished import ClaimArgs, ClaimReply
from spendgate.admission.scripts.tombstone import TombstoneArgs
from spendgate.schemas.backoff import Backoff, store_fault
from spendgate.schemas.events import ReserveEvent, UsageEvent
from spendgate.schemas.layout import Layout
from spendgate.schemas.luascript import LuaScript, run_script
from spendgate.schemas.redis_keys import (
    piece_key,
    provisional_key,
    reservation_key,
    tombstone_key,
    unpublished_reserves_key,
)
from spendgate.streams.scripts import absorb

logger = logging.getLogger(__name__)

__all__ = ["ACKED_BACKLOG", "SWEEP_BATCH", "ReserveSweeper"]

#: Most entries one claim takes (a sweep claims again while it gets full batches).
SWEEP_BATCH = 1_000
#: Reservation ids per ZREM.
ZREM_CHUNK = 1_000
#: Acked reserves waiting to be unlisted while Redis is unreachable; beyond this the
#: oldest are forgotten (they are only republished once more: harmless).
ACKED_BACKLOG = 100_000


def _failed(task: str, backoff: Backoff, exc: BaseException) -> float:
    """Count and log one failure of a background task; returns the delay before its
    next try (``backoff``)."""
    delay = backoff.failed()
    store = store_fault(exc)
    if store:
        STORE_ERRORS.labels(task=task).inc()
    logger.warning(
        "%s: task=%s attempt=%d retry_in_s=%.2f error=%s: %s",
        "store error" if store else "background task failed",
        task,
        backoff.failures,
        delay,
        type(exc).__name__,
        exc,
    )
    return delay


class ReserveSweeper:
    """Keeps the unpublished reserves of one Redis prefix (each of its shards, on a
    cluster) in step with the broker's acks, and releases abandoned pieces.

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
        layout: Layout | None = None,
        wait_replicas: int = 0,
        wait_ms: int = 100,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.publisher = publisher
        self.grace_s = grace_s
        self.interval_s = interval_s
        self.batch = batch
        self.layout = layout or Layout(prefix)
        #: On a cluster: replicas that must hold a tombstone before its piece is released.
        self.wait_replicas = wait_replicas if self.layout.cluster else 0
        self.wait_ms = wait_ms
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
                for prefix, ids in self._by_shard(chunk).items():
                    await self.client.zrem(unpublished_reserves_key(prefix), *ids)
            except BaseException:
                self._acked.extendleft(reversed(chunk))
                raise
            sent += len(chunk)
        return sent

    def _by_shard(self, reservation_ids: list[str]) -> dict[str, list[str]]:
        """The ids grouped by the shard prefix of their record (ids naming no shard of
        this cluster were never listed here: dropped)."""
        out: dict[str, list[str]] = {}
        for rid in reservation_ids:
            try:
                prefix = self.layout.of_reservation(rid)
            except ValueError:
                continue
            out.setdefault(prefix, []).append(rid)
        return out

    async def sweep(self) -> int:
        """Republish every reserve unacknowledged for longer than the grace period.

        Returns:
            How many were republished and acked by the broker now. One claimed but not
            acked in time stays listed and is claimed again after another grace period.

        Raises:
            RedisError: Redis did not answer.
        """
        republished = 0
        failed: Exception | None = None
        for prefix in self.layout.shards():
            try:
                acked, full = await self._sweep_shard(prefix)
            except Exception as exc:
                if not store_fault(exc):
                    raise
                # This shard waits for the next sweep; the others are swept now.
                failed = exc
                continue
            republished += acked
            if not full:
                break
        if failed is not None:
            raise failed
        if republished:
            logger.info(
                "republished %d reserve events unacknowledged for over %.0f s",
                republished,
                self.grace_s,
            )
        return republished

    async def _sweep_shard(self, prefix: str) -> tuple[int, bool]:
        """Republish one shard's overdue reserves; returns (acked, whether every batch
        claimed was acked: False stops the sweep until the next one)."""
        key = unpublished_reserves_key(prefix)
        republished = 0
        cutoff: int | None = None
        while True:
            batch = self._room()
            if batch == 0:
                return republished, False
            call = ClaimArgs(key, int(self.grace_s * 1000), batch, cutoff)
            raw = await run_script(self.client, claim_unpublished.SCRIPT, call.keys(), call.argv())
            reply = ClaimReply.decode(raw)
            cutoff, claimed = reply.cutoff, list(reply.claimed)
            if not claimed:
                return republished, True
            acked, published = await self._republish(prefix, claimed)
            republished += acked
            # A batch not fully acked (Kafka down or slow): the rest waits for the next
            # sweep rather than piling into the publisher's buffer.
            if acked < published:
                return republished, False
            if len(claimed) < batch:
                return republished, True

    async def sweep_pieces(self, now_ms: int | None = None) -> int:
        """Resolve every piece past its deadline on every shard (a cluster only): sealed
        ones leave the provisional set, the others are aborted and released.

        Returns:
            How many pieces were resolved.

        Raises:
            RedisError: Redis did not answer.
        """
        if not self.layout.cluster:
            return 0
        now = int(time.time() * 1000) if now_ms is None else now_ms
        resolved = 0
        failed: Exception | None = None
        for prefix in self.layout.shards():
            # A shard (or a home shard) that does not answer skips its pieces until the
            # next sweep; the other shards' are still resolved.
            try:
                overdue = await self.client.zrangebyscore(
                    provisional_key(prefix), "-inf", now, start=0, num=self.batch
                )
                for raw in overdue:
                    rid = raw.decode() if isinstance(raw, bytes) else str(raw)
                    await self._resolve_piece(prefix, rid)
                    resolved += 1
            except Exception as exc:
                if not store_fault(exc):
                    raise
                failed = exc
        if failed is not None:
            raise failed
        return resolved

    async def _resolve_piece(self, prefix: str, rid: str) -> None:
        """Seal or abort one overdue piece (see the module's doc), then unlist it."""
        client = self.client
        try:
            home = self.layout.of_reservation(rid)
        except ValueError:
            home = None
        sealed = False
        if home is not None:
            call = TombstoneArgs(
                reservation_key(home, rid), tombstone_key(home, rid), IDEMPOTENCY_TTL_MS
            )
            sealed = bool(int(await self._durable(tombstone.SCRIPT, call.keys(), call.argv())))
        if not sealed:
            held = await client.get(piece_key(prefix, rid))
            if held is not None:
                args = release_args(prefix, json.loads(held), rid)
                await run_script(client, absorb.SCRIPT, args.keys(), args.argv())
            logger.warning("released piece %s on %s: never sealed before its deadline", rid, prefix)
        PIECES_SWEPT.labels(result="sealed" if sealed else "released").inc()
        await client.zrem(provisional_key(prefix), rid)
        await client.delete(piece_key(prefix, rid))

    async def _durable(
        self, script: LuaScript, keys: Sequence[str], args: Sequence[bytes | str | int]
    ) -> Any:
        """Run ``script``, answered once ``wait_replicas`` replicas hold its writes."""
        if self.wait_replicas > 0:
            cluster: Any = self.client
            return await run_replicated(
                cluster, script, keys, args, replicas=self.wait_replicas, timeout_ms=self.wait_ms
            )
        return await run_script(self.client, script, keys, args)

    def _room(self) -> int:
        """How many reserves one claim may take: at most half of the publisher's free
        buffer slots, so republishing never fills the buffer live admits need."""
        capacity = getattr(self.publisher, "capacity", None)
        if not isinstance(capacity, int):
            return self.batch
        free = capacity - int(getattr(self.publisher, "depth", 0))
        return max(0, min(self.batch, free // 2))

    async def _republish(self, prefix: str, claimed: list[str]) -> tuple[int, int]:
        """Publish the claimed reserves of one shard; returns (acked, published)."""
        pipe = self.client.pipeline(transaction=False)
        for rid in claimed:
            pipe.hgetall(reservation_key(prefix, rid))
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
            await self.client.zrem(unpublished_reserves_key(prefix), *gone)
        # Concurrent: the publisher shares its produce batches among them.
        acked = await asyncio.gather(*(self.publisher.publish_acked(e) for e in events))
        count = sum(acked)
        RESERVES_REPUBLISHED.inc(count)
        return count, len(events)

    async def _flush_loop(self) -> None:
        # Never a dead task: any failure keeps the ids (flush_acked puts them back) and is
        # tried again after the backoff.
        backoff = Backoff()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self.flush_acked()
            except Exception as exc:  # noqa: BLE001 - a Redis error above all; any: retry
                await asyncio.sleep(_failed("unlist_acked", backoff, exc))
                self._wakeup.set()
            else:
                backoff.succeeded()

    async def _sweep_loop(self) -> None:
        # Every interval_s; after a failure sooner, on the backoff (at most interval_s),
        # so the sweeps resume as soon as Redis answers again. Never a dead task.
        backoffs = {"sweep_reserves": Backoff(), "sweep_pieces": Backoff()}
        wait_s = self.interval_s
        while True:
            await asyncio.sleep(wait_s)
            wait_s = self.interval_s
            for task, sweep in (
                ("sweep_reserves", self.sweep),
                ("sweep_pieces", self.sweep_pieces),
            ):
                try:
                    await sweep()
                except Exception as exc:  # noqa: BLE001 - a Redis error above all; any: retry
                    wait_s = min(wait_s, _failed(task, backoffs[task], exc))
                else:
                    backoffs[task].succeeded()

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
        except Exception as exc:
            if not store_fault(exc):
                raise
            # Left listed: republished once more after the grace period (harmless).
            logger.warning(
                "%d acked reserves stay listed as unpublished (%s)", len(self._acked), exc
            )
