"""Refused admissions on ``budget.refusals``: the demand a refusal left out of the usage log."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spendgate.schemas.events import Subject, Usage, UtcDatetime
from spendgate.schemas.types import Identifier, PolicyId


class Refusal(BaseModel):
    """One refused admission, published by admission without waiting for the broker.

    Not accounted by the worker: a refusal holds no capacity. ``simulate`` and the dashboard
    read it, so history holds the whole demand, not only what was admitted. The same
    ``request_id`` may appear more than once (a client retried after a 429): readers count
    it once. ``violated`` lists the policies that refused it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    request_id: Identifier
    subject: Subject
    estimate: Usage
    violated: list[PolicyId] = Field(default_factory=list)
    decision: Literal["reject"] = "reject"
    at: UtcDatetime


class RefusalGap(BaseModel):
    """Refusals admission dropped (buffer full, or a send failed) between ``since`` and
    ``until``: history is incomplete there. Published on ``budget.refusals`` once the
    publisher can send again, so ``simulate`` reports them beside what it judged."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    kind: Literal["gap"] = "gap"
    dropped: int = Field(gt=0)
    since: UtcDatetime
    until: UtcDatetime
