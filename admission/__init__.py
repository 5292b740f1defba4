"""The admission service: one atomic Redis decision per request, events to Kafka."""

from __future__ import annotations

from admission.app import create_app
from admission.auth import Authorizer
from admission.client import AdmissionClient, AsyncAdmissionClient
from admission.publisher import KafkaPublisher, UsagePublisher
from admission.settings import AdmissionSettings
from admission.store import AdmitResult, BudgetStore, Charge, Plan
from admission.sweeper import ReserveSweeper

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
