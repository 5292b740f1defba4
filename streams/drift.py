"""The drift check: a budgeted number of windows per second compared with Redis, healed."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

from spendgate.streams import metrics
from spendgate.streams.gaps import is_budget_key
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer
from spendgate.streams.policybook import PolicyBook
from spendgate.streams.retry import StoreRetry, store_fault

__all__ = ["DriftCheck", "DriftCycle", "windows_live"]

logger = logging.getLogger(__name__)


class DriftCycle:
    """Walks every key of the table, a few per tick, and times each full pass."""

    def __init__(self) -> None:
        self._keys: Iterator[str] | None = None
        self._started = time.monotonic()

    def next_keys(self, table: Any, budget: int) -> list[str]:
        """Up to ``budget`` keys after the ones already visited in this cycle."""
        if self._keys is None:
            keys = [k for k in table if is_budget_key(k)]  # not the positions
            self._keys, self._started = iter(keys), time.monotonic()
        out = list(itertools.islice(self._keys, budget))
        if len(out) < budget:
            metrics.DRIFT_CYCLE.set(time.monotonic() - self._started)
            metrics.DRIFT_CYCLE_END.set(time.time())
            self._keys = None
        return out


class DriftCheck:
    """Compares ``keys_per_s`` windows per tick with Redis and heals those that differ.

    Args:
        app: the faust app (no check while its tables recover).
        table: the key-state table.
        book: the policies (no check before they are read).
        materializer: Redis.
        keys_per_s: windows compared per tick (0: no check).
        in_flight: keys whose Redis write is in flight (Redis behind for a moment is not
            drift; ``streams.commit.BatchCommit``).
        retry: its Redis errors (a failed tick is counted and logged; the ticks after it
            are skipped until the backoff has passed; the keys it skipped come again in
            the next cycle).
    """

    def __init__(
        self,
        app: Any,
        table: Any,
        book: PolicyBook,
        materializer: RedisMaterializer,
        keys_per_s: int,
        in_flight: set[str],
        retry: StoreRetry | None = None,
    ) -> None:
        self.app = app
        self.table = table
        self.book = book
        self.materializer = materializer
        self.keys_per_s = keys_per_s
        self.in_flight = in_flight
        self.cycle = DriftCycle()
        self.retry = retry or StoreRetry("drift_check")

    async def tick(self) -> None:
        """One tick: the next keys of the cycle compared, the differing ones healed."""
        if not self.keys_per_s or not self.book.ready.is_set() or not self.retry.due():
            return
        recovery = getattr(self.app.tables, "recovery", None)
        if recovery is not None and recovery.in_recovery:
            return
        now_ms = int(time.time() * 1000)
        due: list[tuple[str, KeyState]] = []
        for key in self.cycle.next_keys(self.table, self.keys_per_s):
            if key in self.in_flight:
                continue
            state = KeyState.from_bytes(self.table.get(key))
            if not state.bucket_ms or not windows_live(state, now_ms):
                continue  # nothing left in the window: Redis may have let it expire
            due.append((key, state))
        if not due:
            return
        try:
            healed_keys = await self.materializer.heal_many(due)
        except Exception as exc:
            if not store_fault(exc):
                raise
            self.retry.failed(exc)
            return
        self.retry.succeeded()
        for (key, _), healed in zip(due, healed_keys, strict=True):
            if healed:
                metrics.DRIFT_KEYS.inc()
                logger.warning("budget window %s differed in Redis from the table: healed", key)


def windows_live(state: KeyState, now_ms: int) -> bool:
    """Whether any bucket of ``state`` still counts in its window at ``now_ms``."""
    first = now_ms - state.window_ms - state.bucket_ms
    return any(start >= first for start in state.buckets)
