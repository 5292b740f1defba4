"""``on_exceed: delay``: hold a request that will fit within ``max_delay``, then decide again.

A request whose refusal comes only from ``delay`` policies, and whose exact Retry-After is
within the smallest ``max_delay`` among them (counted from its arrival), is held in this
process and decided again, by the same atomic admit script over every budget, the moment
it can fit. Holding is bounded (``SPENDGATE_DELAY_WAITERS`` per process; a full queue
refuses at once, saying so) and fair: waiters of a budget key are served in arrival order
(one FIFO lock per key, taken in key order, held while waiting), and a new request for a
key that already has waiters queues behind them instead of overtaking.

One outcome per request id: a repeat arriving while the first waits joins that wait and
gets the same answer (in another process, the script's stored answer makes it the same
reservation). A client that disconnects stops the wait before any reservation is made;
if the decision raced the disconnect and reserved, the reservation is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spendgate.admission.decide import AdmitResult, Answer, Plan, PolicyTerms
from spendgate.admission.metrics import DELAY_WAITING, DELAYS

__all__ = ["Delays", "Gone", "Held", "delay_of", "waitable_ms"]

logger = logging.getLogger(__name__)

#: Woken a little after the instant the script named, never before it.
_MARGIN_S = 0.002


class Gone(Exception):
    """Every client waiting for this answer disconnected; nothing is held for them."""


def _terms(plan: Plan) -> list[PolicyTerms]:
    return [
        c.terms if c.terms is not None else PolicyTerms.of(c.target.policy) for c in plan.charges
    ]


def delay_of(plan: Plan) -> tuple[str, ...]:
    """The budget keys of ``plan`` whose policy delays (empty: the request is never held)."""
    return tuple(
        sorted(
            {
                c.target.key
                for c, t in zip(plan.charges, _terms(plan), strict=True)
                if t.delay_ms > 0
            }
        )
    )


def waitable_ms(plan: Plan, result: AdmitResult) -> int | None:
    """How long waiting may help a refusal of ``plan``: the smallest ``max_delay`` among the
    refusing keys, when every refusing enforce key delays and the request can ever fit;
    otherwise None."""
    if (
        result.outcome != "reject"
        or result.never_fits
        or result.retry_after_ms is None
        or result.plan != 0
        or len(result.keys) != len(plan.charges)
    ):
        return None
    allowed: int | None = None
    for terms, key in zip(_terms(plan), result.keys, strict=True):
        if not key.violated or not terms.enforce:
            continue
        if terms.delay_ms <= 0:
            return None
        allowed = terms.delay_ms if allowed is None else min(allowed, terms.delay_ms)
    return allowed


@dataclass
class _Wait:
    """One held request id: its outcome, and how many clients still want it."""

    future: asyncio.Future[Answer]
    clients: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class Held:
    """How to decide and answer one held request (the admit service's side).

    Attributes:
        decide: one run of the admit script over every plan.
        finish: the answer to a final result (publishes its reserve, counts it); called
            once per held request, with how long it was held and, for a refusal, why.
        release: releases the reservation of an admitting result nobody is waiting for.
    """

    decide: Callable[[], Awaitable[AdmitResult]]
    finish: Callable[[AdmitResult, int, str | None], Answer]
    release: Callable[[AdmitResult], Awaitable[None]]


class Delays:
    """The requests this process holds for ``delay`` policies.

    Args:
        max_waiters: how many request ids may wait at once; one more is refused at once.
    """

    def __init__(self, max_waiters: int) -> None:
        self.max_waiters = max_waiters
        self._waits: dict[tuple[str | None, str], _Wait] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @property
    def waiting(self) -> int:
        """Request ids held now."""
        return len(self._waits)

    def has_waiters(self, keys: Sequence[str]) -> bool:
        """Whether a request for any of ``keys`` is held (a newcomer queues behind it)."""
        return any(k in self._locks for k in keys)

    def joinable(self, tenant: str | None, request_id: str) -> bool:
        """Whether this request id is held now (a repeat joins it)."""
        return (tenant, request_id) in self._waits

    async def hold(
        self,
        tenant: str | None,
        request_id: str,
        keys: tuple[str, ...],
        plan: Plan,
        first: AdmitResult | None,
        started: float,
        held: Held,
        gone: Callable[[], Awaitable[None]] | None,
    ) -> Answer:
        """The answer to a request held for ``delay`` (or joining one held already).

        Args:
            tenant, request_id: the request's identity (a repeat joins its wait).
            keys: the delaying budget keys (the FIFO locks taken, in this order).
            plan: plan 0 (which keys refuse, and their ``max_delay``).
            first: the refusal that made it wait, or None when it queued without trying
                (other requests for its keys were already waiting).
            started: ``time.monotonic()`` at its arrival.
            held: the admit service's calls.
            gone: resolves when this client disconnects (None: never).

        Raises:
            Gone: every client of this request id disconnected.
        """
        ident = (tenant, request_id)
        wait = self._waits.get(ident)
        if wait is None:
            if len(self._waits) >= self.max_waiters:
                DELAYS.labels(result="queue_full").inc()
                why = (
                    f"the delay queue is full ({self.max_waiters} requests already waiting "
                    "in this process); retry after Retry-After"
                )
                if first is not None:
                    return held.finish(first, 0, why)
                # Queued without trying: decide once, without holding it.
                return held.finish(await held.decide(), 0, why)
            wait = _Wait(asyncio.get_running_loop().create_future())
            self._waits[ident] = wait
            DELAY_WAITING.set(len(self._waits))
            task = asyncio.create_task(self._run(wait, keys, plan, first, started, held))
            task.add_done_callback(lambda _: self._forget(ident))
        else:
            DELAYS.labels(result="joined").inc()
        return await self._await(wait, gone)

    def _forget(self, ident: tuple[str | None, str]) -> None:
        self._waits.pop(ident, None)
        DELAY_WAITING.set(len(self._waits))

    async def _await(self, wait: _Wait, gone: Callable[[], Awaitable[None]] | None) -> Answer:
        wait.clients += 1
        watcher = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            outcome = asyncio.shield(wait.future)
            if watcher is None:
                return await outcome
            either: list[asyncio.Future[Any]] = [outcome, watcher]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if outcome.done():
                return outcome.result()
            raise Gone("the client disconnected while its request was held")
        finally:
            wait.clients -= 1
            if wait.clients == 0 and not wait.future.done():
                wait.gone.set()
            if watcher is not None:
                watcher.cancel()

    def _lock(self, key: str) -> asyncio.Lock:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        return lock

    def _unlock(self, key: str, acquired: bool) -> None:
        lock, users = self._locks[key]
        if acquired:
            lock.release()
        if users <= 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)

    async def _run(
        self,
        wait: _Wait,
        keys: tuple[str, ...],
        plan: Plan,
        first: AdmitResult | None,
        started: float,
        held: Held,
    ) -> None:
        locks = [(k, self._lock(k)) for k in keys]
        acquired: list[str] = []
        try:
            for key, lock in locks:
                await lock.acquire()
                acquired.append(key)
            answer = await self._decide(wait, plan, first, started, held)
        except Gone as exc:
            DELAYS.labels(result="gone").inc()
            wait.future.set_exception(exc)
        except BaseException as exc:
            wait.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            wait.future.set_result(answer)
        finally:
            for key, _ in locks:
                self._unlock(key, key in acquired)
            # Nobody may be left to read the outcome: mark it read.
            if wait.future.done() and not wait.future.cancelled():
                wait.future.exception()

    async def _decide(
        self,
        wait: _Wait,
        plan: Plan,
        result: AdmitResult | None,
        started: float,
        held: Held,
    ) -> Answer:
        # When ``result`` was decided: a first refusal may have waited for the locks since.
        decided = started
        while True:
            if result is not None:
                now = time.monotonic()
                held_ms = int((now - started) * 1000)
                if result.outcome != "reject":
                    if wait.gone.is_set() and not result.replayed:
                        # Decided as the last client left: nobody will use it.
                        held.finish(result, held_ms, None)
                        await held.release(result)
                        raise Gone("the client disconnected as its request was admitted")
                    DELAYS.labels(result="admitted").inc()
                    return held.finish(result, held_ms, None)
                allowed = waitable_ms(plan, result)
                retry = result.retry_after_ms
                if retry is not None:
                    # What is left of the wait the script named, as of now.
                    retry = max(0, retry - int((now - decided) * 1000))
                if allowed is None or retry is None or held_ms + retry > allowed:
                    DELAYS.labels(result="refused").inc()
                    why = (
                        None
                        if allowed is None or retry is None
                        else f"it fits in {retry} ms, beyond max_delay ({allowed} ms, "
                        f"{held_ms} ms already held)"
                    )
                    return held.finish(result, held_ms, why)
                if retry > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wait.gone.wait(), retry / 1000 + _MARGIN_S)
            if wait.gone.is_set():
                raise Gone("the client disconnected while its request was held")
            decided = time.monotonic()
            result = await held.decide()
