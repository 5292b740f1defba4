"""What one admission process decides on its own while Redis is unreachable.

* ``degraded`` keys: this process may hold at most ``floor(degraded_allowance * limit)``
  of each key per window on its own. Windows here are fixed and epoch-aligned
  (``now_ms // window_ms``), counted from this process's clock; the counters live only in
  this process and start from zero, so N processes may together spend N allowances.
* Reservations admitted without Redis are remembered here so their commit or release
  can be answered by this process, and each request id's answer so a retry is idempotent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from spendgate.schemas.events import Subject
from spendgate.schemas.policies import Policy
from spendgate.schemas.types import FailureMode

__all__ = ["STRICTNESS", "DegradedLedger", "LocalReservation", "strictest"]

#: closed > degraded > open: the strictest failure mode among the matching policies wins.
STRICTNESS: dict[FailureMode, int] = {"open": 0, "degraded": 1, "closed": 2}


def strictest(policies: list[Policy]) -> FailureMode:
    """The failure mode that applies to a request matching ``policies``.

    Observe-mode policies never refuse, so they count as ``open``; no policy at all is
    ``open`` too.
    """
    modes: list[FailureMode] = [p.failure for p in policies if p.mode == "enforce"]
    return max(modes, key=STRICTNESS.__getitem__, default="open")


@dataclass(slots=True)
class LocalReservation:
    """A reservation this process made without Redis."""

    subject: Subject
    settled: str | None = None


class _Bounded(OrderedDict[Hashable, Any]):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Hashable, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class DegradedLedger:
    """In-process counters per budget key and window, and local reservations."""

    def __init__(self, remembered: int = 100_000) -> None:
        self._spent: dict[tuple[str, int, int], int] = {}
        self.reservations = _Bounded(remembered)
        self.answers = _Bounded(remembered)

    @staticmethod
    def allowance(policy: Policy) -> int:
        """The most this process may hold of one key of ``policy`` per window."""
        return int(policy.degraded_allowance * policy.limit)

    def spent(self, policy: Policy, key: str, now_ms: int) -> int:
        """What this process holds of ``key`` in the current window."""
        return self._spent.get(self._slot(policy, key, now_ms), 0)

    def window_left_ms(self, policy: Policy, now_ms: int) -> int:
        """Milliseconds until the current local window of ``policy`` ends."""
        return policy.window_ms - now_ms % policy.window_ms

    def try_charge(self, charges: list[tuple[Policy, str, int]], now_ms: int) -> list[int]:
        """Charge every (policy, key, amount) if all fit their allowance, else none.

        Returns:
            The indexes of the charges that do not fit (empty when charged).
        """
        over = [
            i
            for i, (policy, key, amount) in enumerate(charges)
            if self.spent(policy, key, now_ms) + amount > self.allowance(policy)
        ]
        if over:
            return over
        for policy, key, amount in charges:
            slot = self._slot(policy, key, now_ms)
            self._spent[slot] = self._spent.get(slot, 0) + amount
        self._forget(now_ms)
        return []

    @staticmethod
    def _slot(policy: Policy, key: str, now_ms: int) -> tuple[str, int, int]:
        return (key, policy.window_ms, now_ms // policy.window_ms)

    def _forget(self, now_ms: int) -> None:
        if len(self._spent) < 10_000:
            return
        # Drop the counters of windows that have ended.
        self._spent = {slot: v for slot, v in self._spent.items() if slot[2] >= now_ms // slot[1]}
