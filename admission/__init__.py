"""The admission service: one atomic Redis decision per request, events to Kafka.

The client (:mod:`admission.client`) runs inside inference workers, so importing it, or
this package, loads only httpx and the schemas: the server's names (FastAPI, Redis,
Kafka) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from admission.client import AdmissionClient, AsyncAdmissionClient

if TYPE_CHECKING:
    from admission.app import create_app
    from admission.auth import Authorizer
    from admission.publisher import KafkaPublisher, UsagePublisher
    from admission.settings import AdmissionSettings
    from admission.store import AdmitResult, BudgetStore, Charge, Plan
    from admission.sweeper import ReserveSweeper

#: Server-side names and the module each is imported from on first use.
_SERVER = {
    "AdmissionSettings": "admission.settings",
    "AdmitResult": "admission.store",
    "Authorizer": "admission.auth",
    "BudgetStore": "admission.store",
    "Charge": "admission.store",
    "KafkaPublisher": "admission.publisher",
    "Plan": "admission.store",
    "ReserveSweeper": "admission.sweeper",
    "UsagePublisher": "admission.publisher",
    "create_app": "admission.app",
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
