"""The shared kernel: event, policy and decision models, matching, units, windows."""

from __future__ import annotations

from schemas.decisions import AdmitRequest, BudgetStatus, Decision
from schemas.events import (
    AdjustEvent,
    CommitEvent,
    ReleaseEvent,
    ReserveEvent,
    SignedUsage,
    Subject,
    Usage,
    UsageEvent,
    parse_event,
    partition_key,
)
from schemas.exceptions import (
    ConfigurationError,
    MissingGroupByField,
    PolicyError,
    SpendgateError,
    UnitError,
)
from schemas.matching import BudgetTarget, budget_key, matches, targets
from schemas.policies import Policy
from schemas.units import amount

__all__ = [
    "AdjustEvent",
    "AdmitRequest",
    "BudgetStatus",
    "BudgetTarget",
    "CommitEvent",
    "ConfigurationError",
    "Decision",
    "MissingGroupByField",
    "Policy",
    "PolicyError",
    "ReleaseEvent",
    "ReserveEvent",
    "SignedUsage",
    "SpendgateError",
    "Subject",
    "UnitError",
    "Usage",
    "UsageEvent",
    "amount",
    "budget_key",
    "matches",
    "parse_event",
    "partition_key",
    "targets",
]
