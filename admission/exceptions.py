"""Errors of the admission service and its client.

Tree::

    SpendgateError
    ├── AdmissionError              (status, code) answered as {error: {code, message, field?}}
    │   ├── BadRequest              400 the body or query is wrong (names the field)
    │   ├── Unauthorized            401 no bearer token, or an unknown one
    │   ├── Forbidden               403 the token may not act for this tenant
    │   ├── UnknownReservation      404 commit/release of a reservation not held here
    │   ├── AlreadySettled          409 the reservation was settled the other way
    │   ├── PayloadTooLarge         413 the body is over the size limit
    │   ├── UnsupportedMediaType    415 the body is not JSON
    │   ├── Unprocessable           422 usage cannot be priced or counted
    │   ├── StoreUnavailable        503 Redis cannot be reached and the policy fails closed
    │   ├── Overloaded              503 this process has more Redis calls than it can queue
    │   ├── PublishUnavailable      503 the publish buffer is full and the policy fails closed
    │   └── OutcomeUnknown          503 Kafka did not ack a commit/release in time: retry it
    └── AdmissionClientError        raised by admission.client
        ├── BudgetExceeded          429: carries retry_after_seconds / never_fits
        ├── AdmissionRequestError   any other 4xx: carries status, code, message, field
        └── AdmissionUnavailable    the service kept failing (connection errors, 5xx)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from spendgate.schemas.exceptions import SpendgateError

if TYPE_CHECKING:
    from spendgate.schemas.decisions import Decision


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


class Unauthorized(AdmissionError):
    """No bearer token or an unknown one: send ``Authorization: Bearer <token>``."""

    status = 401
    code = "unauthorized"


class Forbidden(AdmissionError):
    """The token may not act for this tenant: use a token bound to it."""

    status = 403
    code = "forbidden"


class UnknownReservation(AdmissionError):
    """No open reservation has this id: it expired, was settled, or never existed."""

    status = 404
    code = "unknown_reservation"


class AlreadySettled(AdmissionError):
    """The reservation was already released (or committed): it cannot be settled again."""

    status = 409
    code = "already_settled"


class PayloadTooLarge(AdmissionError):
    """The body is over the size limit: send less (estimates and usage are small)."""

    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(AdmissionError):
    """The body is not JSON: send ``Content-Type: application/json``."""

    status = 415
    code = "unsupported_media_type"


class Unprocessable(AdmissionError):
    """The usage cannot be counted under a matching policy (for example an unpriced model)."""

    status = 422
    code = "unprocessable"


class StoreUnavailable(AdmissionError):
    """Redis did not answer and the matching policies fail closed: check Redis."""

    status = 503
    code = "store_unavailable"
    retriable = True


class Unvouched(AdmissionError):
    """Redis holds no budget window its worker vouches for (``state``: ``missing`` after a
    loss of Redis data, until the worker restored it and caught up; ``stale`` when the
    worker is dead or far behind) and the policy fails closed: retry after ``Retry-After``,
    and check the worker (``spendgate_worker_*`` metrics) if it persists."""

    status = 503
    code = "state_unvouched"
    retriable = True

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class Overloaded(AdmissionError):
    """This process is saturated (its queue of Redis calls is full, or a call waited too long
    for a connection or for the event loop): retry the same call after ``Retry-After`` (a
    repeated request id never reserves twice), and add admission processes or
    ``SPENDGATE_REDIS_CONNECTIONS`` if it persists. It is never answered from the policy's
    failure mode, which is for a Redis that does not answer."""

    status = 503
    code = "overloaded"
    retriable = True


class PublishUnavailable(AdmissionError):
    """The publish buffer is full (Kafka unreachable) and the policy fails closed: check Kafka."""

    status = 503
    code = "publish_unavailable"
    retriable = True


class OutcomeUnknown(AdmissionError):
    """Kafka did not acknowledge the commit or release in time, so it may or may not be in
    the log: send the same call again (its event id derives from the reservation, so it is
    counted once) and check Kafka if it keeps failing."""

    status = 503
    code = "outcome_unknown"
    retriable = True


class AdmissionClientError(SpendgateError):
    """Raised by :mod:`admission.client`."""


class BudgetExceeded(AdmissionClientError):
    """A budget refused the request (429): wait ``retry_after_seconds``, or shrink it when
    ``never_fits``."""

    def __init__(self, decision: Decision) -> None:
        wait = (
            "never fits" if decision.never_fits else f"retry after {decision.retry_after_seconds}s"
        )
        super().__init__(f"budget exceeded ({', '.join(decision.violated) or '?'}): {wait}")
        self.decision = decision
        self.retry_after_seconds = decision.retry_after_seconds
        self.never_fits = decision.never_fits
        self.violated = list(decision.violated)


class AdmissionRequestError(AdmissionClientError):
    """The service refused the call (4xx other than 429): fix what the message names."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class AdmissionUnavailable(AdmissionClientError):
    """The service kept failing (connection errors or 5xx) after every retry: check it."""

    retriable = True
