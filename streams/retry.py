"""A Redis error in the worker's agents, timers and tasks is a retry, never a crash.

faust restarts a crashed agent, but a timer or task that raises takes the whole app down
(``[^-App]: Crashed``), and a restarted agent's batch waits for the next record of its
partition before it is written again (the marks meanwhile age past the staleness bound).
Here each failure is counted (``spendgate_worker_store_errors_total{task}``), logged once,
and answered with a bounded backoff (0.1 s doubling to 5 s); an agent's batch is committed
again until Redis has it (:func:`commit_until_written`): the batch commit's own rules
(``streams.commit``: carried writes, redeliveries recognised by position) make the second
attempt count each record once.

A wait on Kafka past its bound (:class:`~streams.exceptions.KafkaWaitExpired`) is committed
again the same way, at once, counted (``spendgate_worker_bound_hits_total{wait}``,
``spendgate_worker_resends_total``) and logged; it is no progress
(``streams.liveness``): a batch that never gets its acks ends the process after
``SPENDGATE_WORKER_EXIT_S``, while a store error, an answer, starts the stall clock over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Container
from typing import Any

from spendgate.schemas.backoff import STORE_ERRORS, Backoff, store_fault
from spendgate.streams import metrics
from spendgate.streams.exceptions import KafkaWaitExpired
from spendgate.streams.liveness import Liveness

__all__ = ["STORE_ERRORS", "StoreRetry", "commit_until_written", "store_fault"]

logger = logging.getLogger(__name__)


class StoreRetry:
    """One task's Redis errors: counted, logged, and spaced by a bounded backoff.

    Args:
        task: the task's name (the metric's label and the log's ``task=``).
        backoff: the delays (default 0.1 s doubling to 5 s).
        clock: monotonic seconds (tests pass their own).
        sleep: awaits a delay (tests pass their own).
    """

    def __init__(
        self,
        task: str,
        backoff: Backoff | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.task = task
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.sleep = sleep
        self._not_before = 0.0

    def failed(self, exc: BaseException) -> float:
        """Count and log ``exc``; returns the delay before the next try."""
        delay = self.backoff.failed()
        self._not_before = self.clock() + delay
        metrics.STORE_ERRORS.labels(task=self.task).inc()
        logger.warning(
            "store error: task=%s attempt=%d retry_in_s=%.2f error=%s: %s",
            self.task,
            self.backoff.failures,
            delay,
            type(exc).__name__,
            exc,
        )
        return delay

    def succeeded(self) -> None:
        """The store answered: the delays start over (logged when it ends failures)."""
        if failures := self.backoff.succeeded():
            logger.info("store answers again: task=%s after %d failures", self.task, failures)

    def due(self) -> bool:
        """Whether the backoff after the last failure has passed (a timer skips its
        ticks until then)."""
        return self.clock() >= self._not_before

    async def wait(self) -> None:
        """Sleep out the backoff after the last failure."""
        left = self._not_before - self.clock()
        if left > 0:
            await self.sleep(left)


async def commit_until_written(
    commit: Callable[[list[Any]], Awaitable[Any]],
    events: list[Any],
    retry: StoreRetry,
    *,
    owned: Callable[[], Container[Any]],
    rebalancing: Callable[[], bool],
    liveness: Liveness | None = None,
    bound_hit: Callable[[KafkaWaitExpired], None] | None = None,
) -> bool:
    """Commit one batch of faust events, again after each Redis error, until it is written.

    A failed attempt leaves the offsets unacked and carries its table writes to the next
    attempt (``streams.commit.BatchCommit``); the records fold again as redeliveries.

    Between attempts the events of partitions this worker no longer owns are dropped (their
    new owner restores from the changelog). A rebalance under way gives the batch up: faust
    waits for every event in process to be acked or gone before it hands partitions over,
    so the events are let go (``events`` emptied in place, nothing acked) and their records
    come again from the group's committed offset once the partitions are assigned.

    Args:
        commit: commits a batch (``BatchCommit.run``).
        events: the batch (emptied when given up).
        retry: the agent's store errors.
        owned: the topic partitions this worker owns now.
        rebalancing: whether a rebalance is under way.
        liveness: told when the batch is taken, moves (a store error answered) and is
            done, under the agent's name (``retry.task``).
        bound_hit: called with each Kafka wait past its bound (the first logs the
            diagnostics).

    Returns:
        True when the batch was written, False when it was given up.
    """
    if liveness is not None:
        liveness.took(retry.task, len(events))
    try:
        return await _until_written(commit, events, retry, owned, rebalancing, liveness, bound_hit)
    finally:
        if liveness is not None:
            liveness.done(retry.task)


async def _until_written(
    commit: Callable[[list[Any]], Awaitable[Any]],
    events: list[Any],
    retry: StoreRetry,
    owned: Callable[[], Container[Any]],
    rebalancing: Callable[[], bool],
    liveness: Liveness | None,
    bound_hit: Callable[[KafkaWaitExpired], None] | None,
) -> bool:
    while True:
        try:
            await commit(events)
        except KafkaWaitExpired as exc:
            metrics.BOUND_HITS.labels(wait=exc.wait).inc()
            metrics.RESENDS.inc()
            logger.warning(
                "kafka wait bound: task=%s %s; the batch of %d events is committed again",
                retry.task,
                exc,
                len(events),
            )
            if bound_hit is not None:
                bound_hit(exc)
        except Exception as exc:
            if not store_fault(exc):
                raise
            delay = retry.failed(exc)
            if liveness is not None:
                liveness.progressed(retry.task, ahead_s=delay)
            await retry.wait()
        else:
            retry.succeeded()
            return True
        mine = owned()
        kept = [e for e in events if e.message.tp in mine]
        if rebalancing() or not kept:
            logger.warning(
                "batch retry: task=%s gave up a batch of %d events (%s); its records come "
                "again from the committed offsets",
                retry.task,
                len(events),
                "a rebalance is under way" if kept else "its partitions moved",
            )
            events.clear()
            return False
        events[:] = kept
