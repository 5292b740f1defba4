"""Bodies of the admission API besides the admit request and decision (``schemas.decisions``).

They live with the service that answers them; the shared kernel keeps the models both
sides of the event log use.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.decisions import BudgetStatus, UnvouchedState
from schemas.events import Usage
from schemas.types import Identifier


class CommitRequest(BaseModel):
    """``POST /v1/commit``: the actual usage of a reserved request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reservation_id: Identifier
    usage: Usage


class ReleaseRequest(BaseModel):
    """``POST /v1/release``: the request ended with nothing to charge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reservation_id: Identifier


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
