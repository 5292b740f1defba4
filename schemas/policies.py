"""Budget policies: what is counted, for whom, over which trailing window."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.types import (
    SUBJECT_FIELDS,
    Boundary,
    Duration,
    FailureMode,
    Mode,
    OnExceed,
    PolicyId,
    Unit,
    parse_duration_ms,
)

_MIN_WINDOW_MS = 30_000
_MAX_WINDOW_MS = 31 * 86_400_000

Threshold = Annotated[float, Field(gt=0, le=1)]


class Policy(BaseModel):
    """One budget rule: no more than ``limit`` ``unit`` in any trailing ``window``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: PolicyId
    match: dict[str, str] = Field(default_factory=dict)
    group_by: list[str] = Field(default_factory=list)
    unit: Unit
    limit: Annotated[int, Field(gt=0, le=2**53 - 1)]
    window: Duration = "24h"
    bucket: Duration = "1m"
    boundary: Boundary = "include"
    mode: Mode = "enforce"
    on_exceed: OnExceed = "reject"
    downgrade_to: str | None = None
    alerts: list[Threshold] = Field(default_factory=lambda: [0.5, 0.8, 1.0])
    failure: FailureMode = "closed"
    degraded_allowance: Annotated[float, Field(gt=0, le=1)] = 0.1
    reservation_ttl: Duration = "15m"
    count_cached_input: bool = True

    @property
    def window_ms(self) -> int:
        """The trailing window in milliseconds."""
        return parse_duration_ms(self.window)

    @property
    def bucket_ms(self) -> int:
        """The bucket width in milliseconds."""
        return parse_duration_ms(self.bucket)

    @property
    def reservation_ttl_ms(self) -> int:
        """How long an unfinished reservation is held before it is charged in full."""
        return parse_duration_ms(self.reservation_ttl)

    @model_validator(mode="after")
    def _check(self) -> Self:
        window_ms, bucket_ms = self.window_ms, self.bucket_ms
        if not _MIN_WINDOW_MS <= window_ms <= _MAX_WINDOW_MS:
            raise ValueError(f"window: {self.window} is outside 30s..31d")
        if bucket_ms % 1000 or bucket_ms > window_ms or window_ms % bucket_ms:
            raise ValueError(
                f"bucket: {self.bucket} must be whole seconds and divide window {self.window}"
            )
        for field in (*self.group_by, *self.match):
            if field not in SUBJECT_FIELDS and not field.startswith("labels."):
                raise ValueError(
                    f"group_by/match: unknown subject field {field!r}; "
                    f"use one of {', '.join(SUBJECT_FIELDS)} or labels.NAME"
                )
        if len(set(self.group_by)) != len(self.group_by):
            raise ValueError("group_by: fields must be unique")
        if list(self.alerts) != sorted(set(self.alerts)):
            raise ValueError("alerts: thresholds must be sorted ascending and unique")
        if (self.on_exceed == "downgrade") != (self.downgrade_to is not None):
            raise ValueError("downgrade_to: required exactly when on_exceed is 'downgrade'")
        if not 1_000 <= self.reservation_ttl_ms <= 86_400_000:
            raise ValueError("reservation_ttl: must be between 1s and 24h")
        return self
