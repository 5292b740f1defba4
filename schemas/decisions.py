"""The admission API's request and answer bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.types import Amount, Identifier, Unit

#: Why Redis's window cannot be vouched for (see ``schemas.shards``).
UnvouchedState = Literal["stale", "missing"]


class AdmitRequest(BaseModel):
    """``POST /v1/admit``: may this request run, holding ``estimate`` until it finishes?"""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: Identifier
    subject: Subject
    estimate: Usage


class BurstStatus(BaseModel):
    """A budget key's token bucket (policy ``burst``) as seen by a decision."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    capacity: int
    #: Whole tokens left after this decision.
    remaining: int
    #: How long an empty bucket takes to fill (the bucket's window, for ``RateLimit``).
    window_seconds: int
    #: When the bucket is full again (its exact refill time, rounded up).
    reset_after_seconds: int


class BudgetStatus(BaseModel):
    """One budget key's state as seen by a decision."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    key: str
    unit: Unit
    limit: int
    used: int
    reserved: int
    remaining: int
    window_seconds: int
    reset_after_seconds: int
    #: ``GET /v1/budgets``: when the key reaches its limit if its recent burn rate goes on
    #: (``schemas.forecast``; 0: now); null when it is not heading there. Left out of
    #: admit answers.
    exhausts_in_seconds: int | None = None
    #: Set when Redis holds no window its worker vouches for: ``missing`` (lost, being
    #: restored) or ``stale`` (the worker is dead or too far behind); the numbers above
    #: are then what Redis holds, and the policy's failure mode decided.
    state: UnvouchedState | None = None
    #: Set for a policy with a ``burst``: its token bucket.
    burst: BurstStatus | None = None


class Decision(BaseModel):
    """The answer to an admit: ``reject`` is a 429, every other decision a 200.

    ``max_output_tokens`` is set with ``cap``: the reduced output the caller must honour.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    decision: Literal["allow", "cap", "downgrade", "route", "observe_reject", "reject"]
    reservation_id: str | None = None
    model: str | None = None
    #: With ``route``: the pool the request must run on (the reservation is held there).
    route_to: str | None = None
    #: Set when an ``on_exceed: delay`` policy held the request: for how long (ms).
    delayed_ms: int | None = None
    #: Why a held request was refused after all (queue full, or it fits only beyond
    #: ``max_delay``).
    reason: str | None = None
    max_output_tokens: Amount | None = None
    violated: list[str] = Field(default_factory=list)
    retry_after_seconds: int | None = None
    never_fits: bool = False
    budgets: list[BudgetStatus] = Field(default_factory=list)
    #: Set when a budget's window could not be vouched for and its policy fails open:
    #: the worst state among them (see :class:`BudgetStatus`).
    state: UnvouchedState | None = None
