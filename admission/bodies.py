"""Bodies of the admission API besides the admit request and decision (``schemas.decisions``).

They live with the service that answers them; the shared kernel keeps the models both
sides of the event log use.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spendgate.schemas.decisions import BudgetStatus, UnvouchedState
from spendgate.schemas.events import Usage
from spendgate.schemas.types import Identifier


class CommitRequest(BaseModel):
    """``POST /v1/commit``: the actual usage of a reserved request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reservation_id: Identifier
    usage: Usage


class ReleaseRequest(BaseModel):
    """``POST /v1/release``: the request ended with nothing to charge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reservation_id: Identifier


class ExtendRequest(BaseModel):
    """``POST /v1/extend``: grow an open reservation by ``add`` (a streaming response).

    ``seq`` numbers the extends of one reservation (1, 2, ...): a retried extend with the
    same ``seq`` is applied once and answered as the first time.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    reservation_id: Identifier
    seq: int = Field(ge=1, le=2**31 - 1)
    add: Usage


class ExtendAnswer(BaseModel):
    """The answer to an extend: ``allow`` (200, grown on every budget) or ``reject`` (429,
    nothing grew; ``violated`` names the refusing policies, ``budgets`` what remains)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decision: Literal["allow", "reject"]
    reservation_id: str
    seq: int
    violated: list[str] = Field(default_factory=list)
    budgets: list[BudgetStatus] = Field(default_factory=list)


class Accepted(BaseModel):
    """The answer to a commit or release: the event is queued for the stream processor."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: Literal["accepted"] = "accepted"
    reservation_id: str


class BudgetList(BaseModel):
    """``GET /v1/budgets``: every budget matching a subject, nothing reserved."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budgets: list[BudgetStatus] = Field(default_factory=list)


class ErrorDetail(BaseModel):
    """What went wrong: a stable ``code``, a message, and the field at fault if any."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: str
    message: str
    field: str | None = None
    #: With ``state_unvouched``: ``missing`` or ``stale``.
    state: UnvouchedState | None = None


class ErrorBody(BaseModel):
    """Every error answer: ``{error: {code, message, field?}}``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: ErrorDetail
