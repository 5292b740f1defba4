"""Admission's plans as the inputs of the decision's pure twin (``schemas.decision``).

The store hands ADMIT each charge's policy terms and amount as script arguments
(``admission.store``); :func:`key_input` hands the same values to the twin, beside the
key's state, so an offline judge (``spendgate simulate``) decides what the script would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from spendgate.admission.decide import Charge, Plan
from spendgate.schemas.burst import BurstState
from spendgate.schemas.decision import KeyInput, KeyWindowState, OnExceed, PlanInput
from spendgate.schemas.windows import WindowSpec

__all__ = ["KeyReading", "key_input", "plan_inputs"]

#: A policy's ``on_exceed`` as ADMIT reads it (``scripts.codes.ON_EXCEED``): ``delay``
#: refuses in the script, the waiting is the caller's.
_ON_EXCEED: dict[str, OnExceed] = {
    "reject": "reject",
    "cap": "cap",
    "downgrade": "alternative",
    "route": "alternative",
    "delay": "reject",
}


@dataclass(frozen=True, slots=True)
class KeyReading:
    """What a key holds when it is judged: absorbed and pending buckets (start ms ->
    amount), whether its window is vouched for, and its token bucket (None: full)."""

    absorbed: Mapping[int, int] = field(default_factory=dict)
    pending: Mapping[int, int] = field(default_factory=dict)
    state: KeyWindowState = "vouched"
    bucket: BurstState | None = None


def key_input(charge: Charge, reading: KeyReading, *, alternatives: bool = True) -> KeyInput:
    """The twin's input for one charge of a plan, as the store builds its script arguments.

    Args:
        charge: the key, its amount, cap terms and alternative plan.
        reading: the key's state.
        alternatives: False when the plans the charge points to are not given.
    """
    policy = charge.target.policy
    burst = charge.terms.burst if charge.terms is not None else None
    if burst is None and policy.burst is not None:
        burst = policy.burst.spec()
    return KeyInput(
        spec=WindowSpec(policy.window_ms, policy.bucket_ms, policy.boundary),
        limit=policy.limit,
        amount=charge.amount,
        observe=policy.mode == "observe",
        on_exceed=_ON_EXCEED[policy.on_exceed],
        alternative=charge.alt if alternatives else 0,
        cap_s=charge.cap.s,
        cap_r=charge.cap.r,
        cap_d=charge.cap.d,
        failure=policy.failure,
        burst=burst,
        absorbed=reading.absorbed,
        pending=reading.pending,
        state=reading.state,
        bucket=reading.bucket,
    )


def plan_inputs(plans: Sequence[Plan], read: Callable[[Charge], KeyReading]) -> list[PlanInput]:
    """Every plan's keys as the twin's inputs, each key's state from ``read``."""
    return [PlanInput(tuple(key_input(c, read(c)) for c in plan.charges)) for plan in plans]
