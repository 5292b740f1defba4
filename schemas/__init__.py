"""The shared kernel: event, policy, price and decision models, matching, units, windows."""

from __future__ import annotations

from schemas.alerts import Alert, AlertKind, alert_id
from schemas.deadletter import DeadLetter, dead_letter
from schemas.decisions import AdmitRequest, BudgetStatus, BurstStatus, Decision
from schemas.events import (
    AdjustEvent,
    CommitEvent,
    ExtendEvent,
    ReleaseEvent,
    ReserveEvent,
    SignedUsage,
    Subject,
    Usage,
    UsageEvent,
    extend_event_id,
    parse_event,
    partition_key,
)
from schemas.exceptions import (
    ConfigurationError,
    MissingGroupByField,
    PolicyError,
    SpendgateError,
    UnitError,
    UnpricedModel,
)
from schemas.matching import BudgetTarget, PolicyIndex, budget_key, matches, targets
from schemas.policies import Burst, Policy, validate_against_catalog
from schemas.prices import ModelPrice, PriceCatalog, cost_micros, load_catalog
from schemas.refusals import Refusal, RefusalGap
from schemas.units import amount

__all__ = [
    "AdjustEvent",
    "AdmitRequest",
    "Alert",
    "AlertKind",
    "BudgetStatus",
    "BudgetTarget",
    "Burst",
    "BurstStatus",
    "CommitEvent",
    "ConfigurationError",
    "DeadLetter",
    "Decision",
    "ExtendEvent",
    "MissingGroupByField",
    "ModelPrice",
    "Policy",
    "PolicyError",
    "PolicyIndex",
    "PriceCatalog",
    "Refusal",
    "RefusalGap",
    "ReleaseEvent",
    "ReserveEvent",
    "SignedUsage",
    "SpendgateError",
    "Subject",
    "UnitError",
    "UnpricedModel",
    "Usage",
    "UsageEvent",
    "alert_id",
    "amount",
    "budget_key",
    "cost_micros",
    "dead_letter",
    "extend_event_id",
    "load_catalog",
    "matches",
    "parse_event",
    "partition_key",
    "targets",
    "validate_against_catalog",
]
