"""Dead-letter records on ``budget.dlq``: why a record was refused, and its exact bytes."""

from __future__ import annotations

import base64
import binascii
import hashlib
from datetime import datetime
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spendgate.schemas.events import UtcDatetime


def _as_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="backslashreplace")


#: How much of a refused record a dead letter carries (twice: as text and as base64).
MAX_ORIGINAL_BYTES = 64 * 1024


class DeadLetter(BaseModel):
    """A refused record.

    ``original`` is the bytes as UTF-8 text with ``\\xNN`` escapes for invalid bytes, for
    people to read; it is ambiguous when the record itself holds such text, so
    ``original_b64`` (standard base64) carries the exact bytes. The two must agree.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    reason: str = Field(min_length=1)
    original: str
    original_b64: str
    #: Size of the whole record; ``original`` holds only its first :data:`MAX_ORIGINAL_BYTES`
    #: when it is larger (``truncated``), so the dead letter always fits in a Kafka record.
    original_size: int = Field(default=0, ge=0)
    original_sha256: str = ""
    truncated: bool = False
    topic: str | None = None
    partition: int | None = Field(default=None, ge=0)
    offset: int | None = Field(default=None, ge=0)
    at: UtcDatetime

    @property
    def raw(self) -> bytes:
        """The original record bytes."""
        return base64.b64decode(self.original_b64, validate=True)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        try:
            raw = self.raw
        except binascii.Error as exc:
            raise ValueError(f"original_b64: not valid base64: {exc}") from exc
        if _as_text(raw) != self.original:
            raise ValueError("original: does not match the bytes in original_b64")
        return self


def dead_letter(
    reason: str,
    raw: bytes,
    *,
    topic: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    at: datetime,
) -> DeadLetter:
    """Build the dead-letter record for ``raw``.

    Args:
        reason: why the record was refused (for example the validation error).
        raw: the record's value bytes exactly as consumed.
        topic: the topic it was read from.
        partition: its partition.
        offset: its offset.
        at: when it was refused (timezone-aware).

    Returns:
        The record, with ``original`` and ``original_b64`` both derived from ``raw``.

    Raises:
        pydantic.ValidationError: ``reason`` is empty, ``at`` is naive, or a position is
            negative.
    """
    kept = raw[:MAX_ORIGINAL_BYTES]
    return DeadLetter(
        reason=reason,
        original=_as_text(kept),
        original_b64=base64.b64encode(kept).decode("ascii"),
        original_size=len(raw),
        original_sha256=hashlib.sha256(raw).hexdigest(),
        truncated=len(kept) < len(raw),
        topic=topic,
        partition=partition,
        offset=offset,
        at=at,
    )
