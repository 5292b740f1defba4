"""What one admission process decides on its own while Redis is unreachable.

* ``degraded`` keys: this process may hold at most ``floor(degraded_allowance * limit)``
  of each key per window on its own. Windows here are fixed and epoch-aligned
  (``now_ms // window_ms``), counted from this process's clock; the counters live only in
  this process and start from zero, so N processes may together spend N allowances.
  A request is judged against them by the admit decision's twin (``schemas.decision``):
  each local window is one bucket as wide as the window, its boundary excluded.
* Reservations admitted without Redis are remembered here so their commit or release
  can be answered by this process, and each request id's answer so a retry is idempotent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from spendgate.admission.answers import Answer, decision_body, make_answer, seconds
from spendgate.admission.plans import Charge
from spendgate.schemas.decision import DecisionResult, KeyInput, PlanInput, decide
from spendgate.schemas.events import Subject
from spendgate.schemas.policies import Policy
from spendgate.schemas.types import FailureMode
from spendgate.schemas.windows import WindowSpec

__all__ = [
    "STRICTNESS",
    "DegradedLedger",
    "FallbackAnswer",
    "LocalReservation",
    "fallback_answer",
    "strictest",
]

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

    def judge(self, charges: Sequence[tuple[Policy, str, int]], now_ms: int) -> DecisionResult:
        """Judge every (policy, key, amount) against this process's allowance, charging
        nothing: the decision's twin (``schemas.decision``) on each key's local window, one
        bucket as wide as the window and the boundary excluded (a fixed, epoch-aligned
        window), so fitting, Retry-After (the window's end) and never-fits (an amount above
        the allowance) are the admit script's rules."""
        keys = []
        for policy, key, amount in charges:
            window_ms = policy.window_ms
            spent = self.spent(policy, key, now_ms)
            start = now_ms - now_ms % window_ms
            keys.append(
                KeyInput(
                    spec=WindowSpec(window_ms, window_ms, "exclude"),
                    limit=self.allowance(policy),
                    amount=amount,
                    absorbed={start: spent} if spent else {},
                )
            )
        return decide([PlanInput(tuple(keys))], now_ms, 0)

    def charge(self, charges: Sequence[tuple[Policy, str, int]], now_ms: int) -> None:
        """Add every (policy, key, amount) to this process's counters."""
        for policy, key, amount in charges:
            slot = self._slot(policy, key, now_ms)
            self._spent[slot] = self._spent.get(slot, 0) + amount
        self._forget(now_ms)

    def try_charge(self, charges: list[tuple[Policy, str, int]], now_ms: int) -> list[int]:
        """Charge every (policy, key, amount) if all fit their allowance, else none.

        Returns:
            The indexes of the charges that do not fit (empty when charged).
        """
        decided = self.judge(charges, now_ms)
        if not decided.admitted:
            return [i for i, k in enumerate(decided.keys) if k.violated]
        self.charge(charges, now_ms)
        return []

    @staticmethod
    def _slot(policy: Policy, key: str, now_ms: int) -> tuple[str, int, int]:
        return (key, policy.window_ms, now_ms // policy.window_ms)

    def _forget(self, now_ms: int) -> None:
        if len(self._spent) < 10_000:
            return
        # Drop the counters of windows that have ended.
        self._spent = {slot: v for slot, v in self._spent.items() if slot[2] >= now_ms // slot[1]}


@dataclass(frozen=True, slots=True)
class FallbackAnswer:
    """What to do without Redis's decision.

    ``mode`` ``closed``: refuse (``closed`` names the policies); otherwise ``answer`` is
    the answer, and when it admits, ``ttl_ms`` is the reservation's TTL (the caller makes
    the reservation id, remembers it and publishes its reserve event).
    """

    mode: Literal["closed", "degraded", "open"]
    closed: tuple[str, ...] = ()
    answer: Answer | None = None
    admitted: bool = False
    ttl_ms: int = 0


def fallback_answer(
    ledger: DegradedLedger,
    charges: Sequence[Charge],
    model: str | None,
    now_ms: int,
    reservation_id: str,
    default_ttl_ms: int,
) -> FallbackAnswer:
    """Decide without Redis, by the strictest failure mode of ``charges``' policies.

    ``degraded`` keys charge this process's own allowance in ``ledger`` (all or none).

    Args:
        ledger: this process's counters while Redis cannot decide.
        charges: the keys concerned (a plan's, or only those Redis cannot vouch for).
        model: the subject's model (as sent).
        now_ms: this process's clock.
        reservation_id: the id an admitted reservation gets.
        default_ttl_ms: the TTL when no policy gives one.
    """
    policies = [c.target.policy for c in charges]
    mode = strictest(policies)
    if mode == "closed":
        closed = tuple(p.id for p in policies if p.mode == "enforce" and p.failure == "closed")
        return FallbackAnswer("closed", closed)
    budgets: list[dict[str, Any]] = []
    extra: dict[str, str] = {"Spendgate-Fallback": mode}
    if mode == "degraded":
        held = [
            c
            for c in charges
            if c.target.policy.mode == "enforce" and c.target.policy.failure == "degraded"
        ]
        asked = [(c.target.policy, c.target.key, c.amount) for c in held]
        decided = ledger.judge(asked, now_ms)
        if decided.admitted:
            ledger.charge(asked, now_ms)
        for c in held:
            p = c.target.policy
            allowance = ledger.allowance(p)
            spent = ledger.spent(p, c.target.key, now_ms)
            budgets.append(
                {
                    "policy": p.id,
                    "key": c.target.key,
                    "unit": p.unit,
                    "limit": max(1, allowance),
                    "used": 0,
                    "reserved": spent,
                    "remaining": max(0, allowance - spent),
                    "window_seconds": p.window_ms // 1000,
                    "reset_after_seconds": seconds(ledger.window_left_ms(p, now_ms)),
                }
            )
        if not decided.admitted:
            refusing = [
                c.target.policy for c, k in zip(held, decided.keys, strict=True) if k.violated
            ]
            wait = decided.retry_after_ms
            body = decision_body(
                "reject",
                violated=[p.id for p in refusing],
                retry_after_seconds=None if wait is None else max(1, seconds(wait)),
                never_fits=decided.never_fits,
                budgets=budgets,
                model=model,
            )
            return FallbackAnswer(mode, answer=make_answer(body, 429, extra))
    ttl_ms = max((p.reservation_ttl_ms for p in policies), default=default_ttl_ms)
    body = decision_body("allow", reservation_id=reservation_id, model=model, budgets=budgets)
    return FallbackAnswer(mode, answer=make_answer(body, 200, extra), admitted=True, ttl_ms=ttl_ms)
