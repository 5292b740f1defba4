"""Turn usage into the amount a policy's unit counts."""

from __future__ import annotations

from schemas.events import SignedUsage, Usage
from schemas.exceptions import UnitError
from schemas.policies import Policy


def amount(policy: Policy, usage: Usage | SignedUsage) -> int:
    """The amount of ``policy.unit`` in ``usage`` (signed for corrections).

    Raises:
        UnitError: ``cost_usd`` is asked for and the usage carries no cost.
    """
    cached = usage.cached_input_tokens if policy.count_cached_input else 0
    match policy.unit:
        case "requests":
            return usage.requests
        case "input_tokens":
            return usage.input_tokens + cached
        case "output_tokens":
            return usage.output_tokens
        case "total_tokens":
            return usage.input_tokens + cached + usage.output_tokens
        case "gpu_seconds":
            return usage.gpu_ms
        case "cost_usd":
            if usage.cost_usd_micros is None:
                raise UnitError(f"policy {policy.id!r} counts cost_usd but the usage has no cost")
            return usage.cost_usd_micros
