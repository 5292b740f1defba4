"""Backpressure in front of Redis: saturation is answered as such, never as an outage.

A process runs at most ``slots`` Redis calls at once (the size of its connection pool),
so a call that has a slot always gets a connection at once and the socket timeout
measures Redis alone. Calls beyond that wait in a bounded queue: when it is full, or a
call waited ``wait_s`` for a slot, it is refused with :class:`Overloaded` (``503
overloaded``, ``Retry-After: 1``) and counted; nothing is reserved.

A socket timeout is blamed on Redis only when this process's event loop kept up: a loop
held up during the call (CPU-bound request handling, a starved process) can fire the
timer before it reads a reply that had arrived, and that is overload too. The loop's
lateness is sampled by a timer that only runs while calls are in flight; held up once
for a fifth of the timeout or more during the call, the timeout is the loop's. In
doubt the answer is ``overloaded``: a Redis that really hangs leaves the loop idle, so
the next timeout is Redis's and the failure mode applies from then on.
"""

from __future__ import annotations

import asyncio
from collections import deque

from redis.exceptions import TimeoutError as RedisTimeoutError

from spendgate.admission.exceptions import Overloaded
from spendgate.admission.metrics import OVERLOADED

__all__ = ["Backpressure", "LoopLag"]


class LoopLag:
    """How late the event loop ran a timer lately, sampled while someone watches.

    Args:
        interval_s: the sampling period (a fraction of the socket timeout).
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        #: (loop time of the sample, how late the timer ran), newest last.
        self._samples: deque[tuple[float, float]] = deque(maxlen=256)
        self.watchers = 0

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sample ``loop`` until :meth:`unwatch` was called as often as this."""
        self.watchers += 1
        if self._handle is None or self._loop is not loop:
            self._loop = loop
            self._schedule(loop)

    def unwatch(self) -> None:
        """One watcher less; the sampling stops with the next tick when none is left."""
        self.watchers -= 1

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + self.interval_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        late = now - self._due
        if late > 0:
            self._samples.append((now, late))
        if self.watchers > 0 and loop is self._loop:
            self._schedule(loop)
        else:
            self._handle = None

    def worst_since(self, since: float) -> float:
        """The longest the loop was held up at once between loop time ``since`` and now.

        A reply that arrived is read late enough to time out only when one turn of the
        loop outlasts the rest of the timeout, so the longest turn is what matters.
        """
        loop = self._loop
        if loop is None:
            return 0.0
        held = (min(late, at - since) for at, late in self._samples if at > since)
        worst = max(held, default=0.0)
        if self._handle is not None:
            # A tick that is due but has not run yet: the loop is being held up right now.
            worst = max(worst, min(loop.time() - self._due, loop.time() - since))
        return worst


class Backpressure:
    """A bounded queue of Redis calls per process.

    Args:
        slots: calls running at once; the Redis connection pool's size.
        queue: calls that may wait for a slot; one more is refused at once.
        wait_s: the longest a call waits for a slot before it is refused.
        timeout_s: the Redis socket timeout; a timeout while the loop was held up once
            for a fifth of it or more is overload, not a Redis failure.
    """

    def __init__(self, slots: int, queue: int, wait_s: float, timeout_s: float) -> None:
        self.slots = slots
        self.queue = queue
        self.wait_s = wait_s
        self.lag_limit_s = timeout_s / 5
        self.lag = LoopLag(interval_s=timeout_s / 10)
        self._free = asyncio.Semaphore(slots)
        #: Calls waiting for a slot, and calls holding one.
        self.waiting = 0
        self.running = 0

    async def acquire(self) -> float:
        """Wait for a slot, boundedly.

        Returns:
            The loop time the call started (for :meth:`blame`).

        Raises:
            Overloaded: the queue is full, or no slot came free within ``wait_s``.
        """
        if self._free.locked():
            if self.waiting >= self.queue:
                OVERLOADED.labels(reason="queue_full").inc()
                raise Overloaded(
                    f"{self.running} Redis calls running and {self.waiting} waiting in this "
                    "process: over its queue; retry shortly"
                )
            self.waiting += 1
            try:
                async with asyncio.timeout(self.wait_s):
                    await self._free.acquire()
            except TimeoutError:
                OVERLOADED.labels(reason="queue_wait").inc()
                raise Overloaded(
                    f"waited {self.wait_s:g}s for one of {self.slots} Redis connections; "
                    "retry shortly"
                ) from None
            finally:
                self.waiting -= 1
        else:
            await self._free.acquire()
        self.running += 1
        loop = asyncio.get_running_loop()
        self.lag.watch(loop)
        return loop.time()

    def release(self) -> None:
        """Give the slot back."""
        self.running -= 1
        self.lag.unwatch()
        self._free.release()

    def blame(self, exc: BaseException, started: float) -> str | None:
        """Why a failed call is overload and not Redis failing, or None when it is Redis.

        ``pool_wait``: no pooled connection came in time (another user of the pool held
        them all); ``loop_lag``: a timeout while the event loop was held up.
        """
        cause = exc.__cause__
        if isinstance(cause, TimeoutError) and "No connection available" in str(exc):
            return "pool_wait"
        timed_out = isinstance(exc, RedisTimeoutError | TimeoutError)
        if timed_out and self.lag.worst_since(started) >= self.lag_limit_s:
            return "loop_lag"
        return None
