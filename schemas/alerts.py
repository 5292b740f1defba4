"""Alerts on ``budget.alerts``, with deterministic ids so a replay re-emits the same ones."""

from __future__ import annotations

import hashlib
import json
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spendgate.schemas.events import UtcDatetime
from spendgate.schemas.policies import Threshold
from spendgate.schemas.types import MAX_AMOUNT, PolicyId, SignedAmount

AlertKind = Literal[
    "threshold", "exhausted", "forecast", "reservation_expired", "overage", "store_failure"
]

_ID_HEX_CHARS = 32


def alert_id(
    policy_id: str,
    key: str,
    kind: AlertKind,
    threshold: float | None,
    crossing_seq: int,
    ref: str | None = None,
) -> str:
    """Return the deterministic id of one alert.

    The id is the first 32 hex digits (128 bits) of the SHA-256 of the canonical JSON
    array ``[1, policy_id, key, kind, threshold, crossing_seq]`` (compact separators,
    non-ASCII kept as UTF-8; the leading ``1`` versions the scheme). JSON quoting keeps
    the parts unambiguous, and floats print as their shortest round-trip form, so the
    same inputs give the same id in every process and on every replay.

    Args:
        policy_id: the policy the alert is about.
        key: the budget key.
        kind: the alert kind.
        threshold: the threshold crossed (``kind == "threshold"``), else usually ``None``.
        crossing_seq: which occurrence this is for the same policy, key, kind and
            threshold, counted from 0 by the emitter in event order (a threshold re-arms
            when usage falls back under it; its next crossing takes the next number).
        ref: what the alert is about when that is not a crossing, such as the
            reservation id of ``reservation_expired``; appended to the array when given.

    Returns:
        A 32-character lowercase hex string.
    """
    parts: list[object] = [1, policy_id, key, kind, threshold, crossing_seq]
    if ref is not None:
        parts.append(ref)
    canonical = json.dumps(
        parts,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_ID_HEX_CHARS]


class Alert(BaseModel):
    """One alert on ``budget.alerts``; build ``alert_id`` with :func:`alert_id`.

    Kinds: ``threshold`` (usage crossed ``threshold`` of ``limit``; fires once per
    crossing), ``exhausted`` (the budget is used up), ``forecast`` (at its recent burn
    rate the key exhausts within the policy's ``forecast`` horizon; once per crossing,
    re-armed when the prediction recedes), ``reservation_expired`` (a
    reservation was charged its estimate at expiry), ``overage`` (a commit above its
    reservation: ``estimate``, ``reserved``, ``actual``; the part above was charged at the
    commit's instant), ``store_failure`` (admission could not reach its store for this
    budget).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    alert_id: str = Field(min_length=1, max_length=128)
    kind: AlertKind
    policy: PolicyId
    key: str = Field(min_length=1)
    threshold: Threshold | None = None
    used: SignedAmount
    limit: int = Field(gt=0, le=MAX_AMOUNT)
    at: UtcDatetime
    reservation_id: str | None = None
    #: ``forecast``: the predicted time to exhaustion at the recent burn rate.
    exhausts_in_seconds: int | None = Field(default=None, ge=0)
    #: With ``overage``: the reservation's estimate, everything it reserved (estimate and
    #: extends) and the actual usage committed, in the policy's unit.
    estimate: int | None = Field(default=None, ge=0, le=MAX_AMOUNT)
    reserved: int | None = Field(default=None, ge=0, le=MAX_AMOUNT)
    actual: int | None = Field(default=None, ge=0, le=MAX_AMOUNT)

    @model_validator(mode="after")
    def _threshold_given(self) -> Self:
        if self.kind == "threshold" and self.threshold is None:
            raise ValueError("threshold: required when kind is 'threshold'")
        if self.kind == "overage" and (self.estimate is None or self.actual is None):
            raise ValueError("estimate: estimate and actual are required when kind is 'overage'")
        return self
