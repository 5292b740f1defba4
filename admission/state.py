"""What the admission routes read from ``app.state``: one typed object, built by ``create_app``."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from spendgate.admission.admit import AdmitService
from spendgate.admission.auth import Authorizer
from spendgate.admission.extend import ExtendService
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.settle import Settler
from spendgate.admission.store import BudgetStore

__all__ = ["AdmissionState", "state_of"]


@dataclass(frozen=True, slots=True)
class AdmissionState:
    """The dependencies of every admission endpoint (``app.state.admission``).

    Attributes:
        store: Redis access.
        publisher: where reserve/commit/release/extend events go.
        authorizer: bearer-token auth (disabled when it holds no tokens).
        admits: the admit logic, behind both entrances of ``POST /v1/admit``.
        extender: the extend logic.
        settler: commit and release.
        max_body_bytes: larger bodies are refused with 413.
    """

    store: BudgetStore
    publisher: UsagePublisher
    authorizer: Authorizer
    admits: AdmitService
    extender: ExtendService
    settler: Settler
    max_body_bytes: int


def state_of(connection: HTTPConnection) -> AdmissionState:
    """The admission state of the app serving ``connection`` (a request)."""
    state: AdmissionState = connection.app.state.admission
    return state
