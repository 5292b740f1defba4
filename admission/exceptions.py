"""Errors of the admission service, each mapped to one HTTP answer.

Tree::

    SpendgateError
    └── AdmissionError            (status, code)
        ├── BadRequest            400 the body or query is wrong (names the field)
        ├── UnknownReservation    404 commit/release of a reservation not held here
        ├── Unprocessable         422 usage cannot be priced or counted
        └── StoreUnavailable      503 Redis cannot be reached and the policy fails closed
"""

from __future__ import annotations

from typing import ClassVar

from schemas.exceptions import SpendgateError


class AdmissionError(SpendgateError):
    """An error answered to the caller as ``{error: {code, message, field?}}``."""

    status: ClassVar[int] = 400
    code: ClassVar[str] = "bad_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class BadRequest(AdmissionError):
    """The request is malformed: fix the field named in the message."""


class UnknownReservation(AdmissionError):
    """No open reservation has this id: it expired, was settled, or never existed."""

    status = 404
    code = "unknown_reservation"


class Unprocessable(AdmissionError):
    """The usage cannot be counted under a matching policy (for example an unpriced model)."""

    status = 422
    code = "unprocessable"


class StoreUnavailable(AdmissionError):
    """Redis did not answer and the matching policies fail closed: check Redis."""

    status = 503
    code = "store_unavailable"
    retriable = True
