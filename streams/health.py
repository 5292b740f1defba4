"""What the worker knows of its own partitions, for its readiness endpoint (pure)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

#: vouched: this worker's mark of the partition is written and within the staleness bound;
#: stale: written, but older than the bound (admission refuses on it: the worker is behind);
#: held: the mark is held back (after a loss of Redis data, until caught up);
#: restoring: the partition's windows are being rewritten into Redis (after an assignment).
PartitionState = Literal["vouched", "stale", "held", "restoring"]


@dataclass(frozen=True, slots=True)
class PartitionHealth:
    """One owned partition as the worker last saw it."""

    field: str
    state: PartitionState
    watermark_ms: int | None
    records_behind: int | None


class WorkerHealth:
    """Shared between the worker's event loop (writer) and its HTTP thread (reader)."""

    def __init__(self, stale_after_s: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._partitions: tuple[PartitionHealth, ...] = ()
        self._assigned = False
        self._generation: int | None = None
        self._updated = 0.0
        self.stale_after_s = stale_after_s

    def update(
        self,
        partitions: Iterable[PartitionHealth],
        *,
        assigned: bool,
        generation: int | None = None,
    ) -> None:
        """Replace what is known: every owned partition, whether an assignment is in, and
        the consumer group generation this worker last joined (None: not joined yet)."""
        with self._lock:
            self._partitions = tuple(partitions)
            self._assigned = assigned
            self._generation = generation
            self._updated = time.monotonic()

    def ready(self) -> bool:
        """Assigned, every owned partition vouched for, and updated recently."""
        with self._lock:
            fresh = time.monotonic() - self._updated <= self.stale_after_s
            return self._assigned and fresh and all(p.state == "vouched" for p in self._partitions)

    def snapshot(self) -> dict[str, Any]:
        """The JSON body of the readiness endpoint."""
        ready = self.ready()
        with self._lock:
            return {
                "ready": ready,
                "assigned": self._assigned,
                "generation": self._generation,
                "updated_s_ago": round(time.monotonic() - self._updated, 3)
                if self._updated
                else None,
                "partitions": [asdict(p) for p in self._partitions],
            }
