"""The admission service: one atomic Redis decision per request, events to Kafka.

The client (:mod:`admission.client`) runs inside inference workers, so importing it, or
this package, loads only httpx and the schemas: the server's names (FastAPI, Redis,
Kafka) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spendgate.admission.client import AdmissionClient, AsyncAdmissionClient

if TYPE_CHECKING:
    from spendgate.admission.app import create_app
    from spendgate.admission.auth import Authorizer
    from spendgate.admission.publisher import KafkaPublisher, UsagePublisher
    from spendgate.admission.settings import AdmissionSettings
    from spendgate.admission.store import AdmitResult, BudgetStore, Charge, Plan
    from spendgate.admission.sweeper import ReserveSweeper

#: Server-side names and the module each is imported from on first use.
_SERVER = {
    "AdmissionSettings": "spendgate.admission.settings",
    "AdmitResult": "spendgate.admission.store",
    "Authorizer": "spendgate.admission.auth",
    "BudgetStore": "spendgate.admission.store",
    "Charge": "spendgate.admission.store",
    "KafkaPublisher": "spendgate.admission.publisher",
    "Plan": "spendgate.admission.store",
    "ReserveSweeper": "spendgate.admission.sweeper",
    "UsagePublisher": "spendgate.admission.publisher",
    "create_app": "spendgate.admission.app",
}


def __getattr__(name: str) -> Any:
    module = _SERVER.get(name)
    if module is None:
        raise AttributeError(f"module 'admission' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AdmissionClient",
    "AdmissionSettings",
    "AdmitResult",
    "AsyncAdmissionClient",
    "Authorizer",
    "BudgetStore",
    "Charge",
    "KafkaPublisher",
    "Plan",
    "ReserveSweeper",
    "UsagePublisher",
    "create_app",
]
