"""The worker's watchdog: a thread of its own that judges progress and ends a stuck process.

A thread, not a task, so that it judges even an event loop blocked in a call. Every
``interval_s`` it asks :class:`streams.liveness.Liveness`:

- a **stall** (no progress within ``SPENDGATE_WORKER_STALL_S``) is logged once with its
  reason and the diagnostics (``streams.diagnose``), counted
  (``spendgate_worker_bound_hits_total{wait="progress"}``) and shown by
  ``spendgate_worker_stalled`` (and by ``/healthz``, which asks the same liveness);
- **no progress within** ``SPENDGATE_WORKER_EXIT_S``: the diagnostics again, one CRITICAL
  line, and the process exits with :data:`~streams.liveness.EXIT_STALLED` at once (the
  records come again from the committed offsets; nothing unacked is lost);
- **a stop that outlasts its grace** (``SPENDGATE_WORKER_STOP_GRACE_S`` after SIGTERM or
  SIGINT: a producer flush that waits for acks that never come): the same exit, in-flight
  work dropped unacked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from spendgate.streams import metrics
from spendgate.streams.liveness import EXIT_STALLED, Liveness

__all__ = ["Watchdog"]

logger = logging.getLogger(__name__)


def _exit_now(code: int) -> None:
    """End the process at once: flush the logs first (``os._exit`` skips it)."""
    logging.shutdown()
    os._exit(code)


class Watchdog:
    """Judge ``liveness`` every ``interval_s`` in a daemon thread.

    Args:
        liveness: the worker's progress.
        diagnose: returns the diagnostics report (``streams.diagnose.report``), given why.
        exit: ends the process with a code (tests pass their own).
        clock: monotonic seconds (tests pass their own).
        interval_s: how often it judges.
    """

    def __init__(
        self,
        liveness: Liveness,
        diagnose: Callable[[str], str],
        *,
        exit: Callable[[int], None] = _exit_now,  # noqa: A002 - the exit to call
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 0.25,
    ) -> None:
        self.liveness = liveness
        self.diagnose = diagnose
        self.exit = exit
        self.clock = clock
        self.interval_s = interval_s
        self._stalled = False
        self._dumped = False
        self._stop_by: float | None = None
        self._grace_s = 0.0
        # Reentrant: the SIGTERM handler (``stopping``) runs in the main thread, maybe
        # while that thread holds the lock in ``first_dump``.
        self._lock = threading.RLock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def first_dump(self, why: str) -> None:
        """Log the diagnostics once per process (the first hit of any bound)."""
        with self._lock:
            if self._dumped:
                return
            self._dumped = True
        logger.error("%s", self.diagnose(why))

    def stopping(self, grace_s: float) -> None:
        """A stop was asked: exit after ``grace_s`` unless the process is gone by then
        (idempotent: the first request's deadline holds)."""
        with self._lock:
            if self._stop_by is None:
                self._stop_by = self.clock() + grace_s
                self._grace_s = grace_s

    def check(self) -> None:
        """One judgement (the thread calls it every ``interval_s``)."""
        verdict = self.liveness.verdict()
        if not verdict.healthy and not self._stalled:
            self._stalled = True
            metrics.STALLED.set(1)
            metrics.BOUND_HITS.labels(wait="progress").inc()
            logger.error(
                "worker stalled: %s (SPENDGATE_WORKER_STALL_S=%s); /healthz answers 503",
                verdict.reason,
                self.liveness.stall_s,
            )
            self.first_dump(f"stalled: {verdict.reason}")
        elif verdict.healthy and self._stalled:
            self._stalled = False
            metrics.STALLED.set(0)
            logger.warning("worker makes progress again; /healthz answers 200")
        ending = self.liveness.must_exit()
        if not ending.healthy:
            self._end(
                f"no progress: {ending.reason} (SPENDGATE_WORKER_EXIT_S={self.liveness.exit_s})"
            )
            return
        with self._lock:
            stop_by, grace_s = self._stop_by, self._grace_s
        if stop_by is not None and self.clock() >= stop_by:
            self._end(
                f"the stop asked {grace_s:.1f} s ago has not finished "
                f"(SPENDGATE_WORKER_STOP_GRACE_S={grace_s})"
            )

    def _end(self, why: str) -> None:
        logger.error("%s", self.diagnose(why))
        logger.critical(
            "worker exits %d: %s; its unacked records come again from the committed "
            "offsets once its supervisor starts it again",
            EXIT_STALLED,
            why,
        )
        self._halt.set()
        self.exit(EXIT_STALLED)

    def start(self) -> Watchdog:
        """Judge in a daemon thread (it dies with the process)."""
        self._thread = threading.Thread(target=self._run, name="worker-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop judging (tests)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # a watchdog that dies watches nothing: log and go on
                logger.exception("worker watchdog: a check failed")
