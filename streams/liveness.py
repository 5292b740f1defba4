"""Whether the worker makes progress: the verdict of ``/healthz`` and of the self-exit (pure).

Shared between the worker's event loop (writer) and the watchdog and HTTP threads
(readers). The loop beats (:meth:`Liveness.beat`, every fraction of a second from a task
of its own); each agent says when it took a batch and when the batch was written, and
every sign of progress in between (a store error answered, so a retry; records read
back); a wait outside the agents (faust's offset commit, which first flushes the producer)
is noted while it lasts (:meth:`Liveness.waiting`). Two bounds judge it:

- **stalled** (``SPENDGATE_WORKER_STALL_S``): the loop has not beaten, an agent holds
  records and has made no progress, or a noted wait has lasted, for this long:
  ``/healthz`` answers 503 saying why;
- **must exit** (``SPENDGATE_WORKER_EXIT_S``, larger): the same for this long: the
  watchdog (``streams.watchdog``) exits the process with :data:`EXIT_STALLED`, so its
  supervisor starts it again; the records come again from the committed offsets.

An idle worker (no batch held) is healthy however long it waits for records, and so is
one whose store fails: every store error is an answer, and the batch is tried again after
a backoff (``streams.retry``). A Redis outage therefore never makes every worker restart at
once; ``/readyz`` answers 503 meanwhile (its marks go stale).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EXIT_STALLED", "Held", "Liveness", "Verdict"]

#: The worker's exit code when it stopped itself after no progress within
#: ``SPENDGATE_WORKER_EXIT_S`` (listed with the others in the README).
EXIT_STALLED = 4


@dataclass(frozen=True, slots=True)
class Held:
    """One agent's batch in hand: how many records, since when (monotonic), and when it
    last made progress."""

    records: int
    since: float
    progress: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the watchdog and ``/healthz`` conclude."""

    healthy: bool
    #: Why not healthy (one line for the log and the probe's body), else None.
    reason: str | None
    #: Seconds without progress of the worst case (0 when healthy and idle).
    stalled_s: float

    def body(self) -> dict[str, object]:
        """The JSON body of ``/healthz``."""
        if self.healthy:
            return {"status": "ok"}
        return {"status": "stalled", "reason": self.reason, "stalled_s": round(self.stalled_s, 3)}


class Liveness:
    """Progress of the event loop and of each agent's batch.

    Args:
        stall_s: no progress for this long is a stall (``/healthz`` fails).
        exit_s: no progress for this long ends the process (must be above ``stall_s``).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self, stall_s: float, exit_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 < stall_s < exit_s:
            raise ValueError(f"need 0 < stall_s < exit_s, got {stall_s} and {exit_s}")
        self.stall_s = stall_s
        self.exit_s = exit_s
        self.clock = clock
        self._lock = threading.Lock()
        self._beat = clock()
        self._held: dict[str, Held] = {}
        self._waits: dict[str, float] = {}

    def beat(self) -> None:
        """The event loop ran (called from a task of the loop's own)."""
        now = self.clock()
        with self._lock:
            self._beat = now

    def took(self, agent: str, records: int) -> None:
        """``agent`` took a batch of ``records`` to commit."""
        now = self.clock()
        with self._lock:
            self._held[agent] = Held(records, now, now)

    def progressed(self, agent: str, ahead_s: float = 0.0) -> None:
        """``agent``'s batch moved (a store error answered, records read back): its stall
        clock starts over, ``ahead_s`` from now (a backoff it sleeps before its next try
        is no stall)."""
        now = self.clock()
        with self._lock:
            if (held := self._held.get(agent)) is not None:
                self._held[agent] = Held(held.records, held.since, now + ahead_s)

    def done(self, agent: str) -> None:
        """``agent``'s batch is written (or given up): it holds nothing."""
        with self._lock:
            self._held.pop(agent, None)

    def waiting(self, what: str) -> None:
        """``what`` is waited for (from now, unless already noted)."""
        now = self.clock()
        with self._lock:
            self._waits.setdefault(what, now)

    def ended(self, what: str) -> None:
        """``what`` is no longer waited for."""
        with self._lock:
            self._waits.pop(what, None)

    def held(self) -> dict[str, Held]:
        """The batches in hand by agent."""
        with self._lock:
            return dict(self._held)

    def verdict(self, bound_s: float | None = None) -> Verdict:
        """Healthy unless the loop or an agent has made no progress for ``bound_s``
        (default the stall bound); the worst case names the reason."""
        bound = self.stall_s if bound_s is None else bound_s
        now = self.clock()
        with self._lock:
            beat = self._beat
            held = dict(self._held)
            waits = dict(self._waits)
        worst: tuple[float, str] = (
            now - beat,
            f"the event loop has not run for {now - beat:.1f} s",
        )
        for agent, h in sorted(held.items()):
            idle = max(0.0, now - h.progress)
            if idle > worst[0]:
                worst = (
                    idle,
                    f"agent {agent} holds a batch of {h.records} records taken "
                    f"{now - h.since:.1f} s ago, with no progress for {idle:.1f} s",
                )
        for what, since in sorted(waits.items()):
            if now - since > worst[0]:
                worst = (now - since, f"{what} has waited {now - since:.1f} s")
        stalled_s, reason = worst
        if stalled_s > bound:
            return Verdict(False, reason, stalled_s)
        return Verdict(True, None, stalled_s if held else 0.0)

    def must_exit(self) -> Verdict:
        """The verdict at the exit bound: unhealthy means the process must end."""
        return self.verdict(self.exit_s)
