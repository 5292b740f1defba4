"""Shared constrained types for the spendgate models."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field

#: Largest amount any counter holds: Redis Lua numbers are doubles, exact to 2**53.
MAX_AMOUNT = 2**53 - 1

Amount = Annotated[int, Field(ge=0, le=MAX_AMOUNT)]
SignedAmount = Annotated[int, Field(ge=-MAX_AMOUNT, le=MAX_AMOUNT)]
PolicyId = Annotated[str, Field(pattern=r"^[a-z0-9._-]{1,64}$")]
Identifier = Annotated[str, Field(min_length=1, max_length=200)]
SubjectValue = Annotated[str, Field(min_length=1, max_length=200)]
#: A model name or a glob over model names (``claude-opus-*``), as in a price catalog.
ModelPattern = Annotated[str, Field(min_length=1, max_length=200)]


def _strict_bool(value: object) -> object:
    """``true``/``false`` (any case) from the environment; booleans as they are; anything
    else (``yes``, ``1``, ``on``) is left for the bool check to refuse."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


#: A setting that is a switch: only ``true`` or ``false``, never a guess from ``yes``/``1``.
Switch = Annotated[bool, BeforeValidator(_strict_bool), Field(strict=True)]

Unit = Literal[
    "requests", "input_tokens", "output_tokens", "total_tokens", "cost_usd", "gpu_seconds"
]
Boundary = Literal["include", "exclude", "prorate"]
Mode = Literal["enforce", "observe"]
OnExceed = Literal["reject", "cap", "downgrade", "route", "delay"]
FailureMode = Literal["closed", "open", "degraded"]
Unpriced = Literal["reject", "charge_default"]
OverageMode = Literal["record", "cap_next"]
SubjectField = Literal["tenant", "team", "project", "api_key", "user", "model", "pool", "env"]

SUBJECT_FIELDS: tuple[str, ...] = (
    "tenant",
    "team",
    "project",
    "api_key",
    "user",
    "model",
    "pool",
    "env",
)
LABEL_PREFIX = "labels."

_DURATION_PATTERN = r"^([0-9]+)(ms|s|m|h|d)$"
_DURATION = re.compile(_DURATION_PATTERN)
_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)


def parse_duration_ms(text: str) -> int:
    """Parse a duration such as ``30s``, ``1m``, ``24h`` or ``31d``.

    Args:
        text: a positive integer followed by ``ms``, ``s``, ``m``, ``h`` or ``d``.

    Returns:
        The duration in milliseconds.

    Raises:
        ValueError: the text is not such a duration.
    """
    found = _DURATION.match(text)
    if found is None or int(found.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration like 30s, 15m, 24h or 7d")
    return int(found.group(1)) * _UNIT_MS[found.group(2)]


def epoch_ms(moment: datetime) -> int:
    """Return an aware datetime as integer milliseconds since the epoch, floored.

    Exact integer arithmetic: ``int(ts.timestamp() * 1000)`` can land one millisecond
    early through float rounding, which moves an event into the previous bucket.

    Args:
        moment: a timezone-aware datetime.

    Returns:
        Milliseconds since 1970-01-01T00:00:00Z (floor for sub-millisecond parts).
    """
    return (moment - _EPOCH) // _ONE_MS


def _duration(text: str) -> str:
    parse_duration_ms(text)
    return text


def _subject_field(name: str) -> str:
    if name in SUBJECT_FIELDS:
        return name
    if name.startswith(LABEL_PREFIX) and len(name) > len(LABEL_PREFIX):
        return name
    raise ValueError(
        f"unknown subject field {name!r}; use one of {', '.join(SUBJECT_FIELDS)} or labels.NAME"
    )


#: A duration string such as ``24h``, kept as written so policies round-trip unchanged.
Duration = Annotated[str, Field(pattern=_DURATION_PATTERN), AfterValidator(_duration)]

#: A subject field a policy matches or groups on: a fixed field or ``labels.NAME``.
SubjectFieldName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=207,
        json_schema_extra={
            "pattern": r"^(tenant|team|project|api_key|user|model|pool|env|labels\..+)$"
        },
    ),
    AfterValidator(_subject_field),
]
