"""The admission service: one atomic Redis decision per request, events to Kafka."""

from __future__ import annotations

from admission.app import create_app
from admission.publisher import KafkaPublisher, UsagePublisher
from admission.settings import AdmissionSettings
from admission.store import AdmitResult, BudgetStore, Charge

__all__ = [
    "AdmissionSettings",
    "AdmitResult",
    "BudgetStore",
    "Charge",
    "KafkaPublisher",
    "UsagePublisher",
    "create_app",
]
