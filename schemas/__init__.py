"""The shared kernel: event, policy, price and decision models, matching, units, windows."""

from __future__ import annotations

from spendgate.schemas.alerts import Alert, AlertKind, alert_id
from spendgate.schemas.deadletter import DeadLetter, dead_letter
from spendgate.schemas.decisions import AdmitRequest, BudgetStatus, BurstStatus, Decision
from spendgate.schemas.events import (
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
from spendgate.schemas.exceptions import (
    ConfigurationError,
    MissingGroupByField,
    PolicyError,
    SpendgateError,
    UnitError,
    UnpricedModel,
)
from spendgate.schemas.matching import BudgetTarget, PolicyIndex, budget_key, matches, targets
from spendgate.schemas.policies import Burst, Policy, validate_against_catalog
from spendgate.schemas.prices import ModelPrice, PriceCatalog, cost_micros, load_catalog
from spendgate.schemas.refusals import Refusal, RefusalGap
from spendgate.schemas.units import amount

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
