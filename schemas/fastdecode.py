"""Fast decode of usage records: msgspec Structs on the hot path, the pydantic models as judge.

:func:`decode` accepts exactly what :func:`schemas.events.parse_event` accepts and refuses
exactly what it refuses, with the same error: the msgspec path takes only a strict subset
of the valid JSON it can check on its own terms (integers as JSON integers, times as
``YYYY-MM-DDTHH:MM:SS[.ffffff](Z|+HH:MM)``); everything else, valid or not, goes to
``parse_event``, so refusals (and their dead-letter reasons) come from the models, and
rarer valid spellings (``5.0``, a numeric timestamp) are read as the models read them.
Both paths return the same plain :class:`Event`, the form the fold works on.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from spendgate.schemas.events import (
    AdjustEvent,
    EventKind,
    ReleaseEvent,
    ReserveEvent,
    SignedUsage,
    Subject,
    Usage,
    UsageEvent,
    parse_event,
)
from spendgate.schemas.types import MAX_AMOUNT

__all__ = ["Event", "FastSubject", "FastUsage", "Kind", "decode", "from_model"]

#: The kinds of event (one table: ``schemas.events.EventKind``).
Kind = EventKind

_Ident = Annotated[str, Meta(min_length=1, max_length=200)]
_Amount = Annotated[int, Meta(ge=0, le=MAX_AMOUNT)]
_Signed = Annotated[int, Meta(ge=-MAX_AMOUNT, le=MAX_AMOUNT)]
#: The one time spelling taken here; a subset of what the models read identically.
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?(?:Z|[+-]\d{2}:\d{2})")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)


class FastSubject(Struct, frozen=True, forbid_unknown_fields=True):
    """:class:`schemas.events.Subject` as msgspec decodes it."""

    tenant: _Ident | None = None
    team: _Ident | None = None
    project: _Ident | None = None
    api_key: _Ident | None = None
    user: _Ident | None = None
    model: _Ident | None = None
    pool: _Ident | None = None
    env: _Ident | None = None
    labels: Annotated[dict[_Ident, _Ident], Meta(max_length=32)] = msgspec.field(
        default_factory=dict
    )

    def value(self, field: str) -> str | None:
        """Return a subject field, or ``labels.NAME`` for a free label."""
        if field.startswith("labels."):
            return self.labels.get(field.removeprefix("labels."))
        found = getattr(self, field, None)
        return found if isinstance(found, str) else None


class FastUsage(Struct, frozen=True, forbid_unknown_fields=True):
    """:class:`schemas.events.Usage` as msgspec decodes it (same field names and types)."""

    requests: _Amount = 0
    input_tokens: _Amount = 0
    cached_input_tokens: _Amount = 0
    output_tokens: _Amount = 0
    gpu_ms: _Amount = 0
    cost_usd_micros: _Amount | None = None


class _FastSignedUsage(Struct, frozen=True, forbid_unknown_fields=True):
    requests: _Signed = 0
    input_tokens: _Signed = 0
    cached_input_tokens: _Signed = 0
    output_tokens: _Signed = 0
    gpu_ms: _Signed = 0
    cost_usd_micros: _Signed | None = None


class _Base(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="kind"):
    event_id: _Ident
    subject: FastSubject
    occurred_at: str
    schema_version: Literal[1] = 1


class _Reserve(_Base, frozen=True, tag="reserve"):
    reservation_id: _Ident
    usage: FastUsage
    expires_at: str


class _Extend(_Base, frozen=True, tag="extend"):
    reservation_id: _Ident
    seq: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    usage: FastUsage


class _Commit(_Base, frozen=True, tag="commit"):
    usage: FastUsage
    reservation_id: _Ident | None = None


class _Release(_Base, frozen=True, tag="release"):
    reservation_id: _Ident


class _Adjust(_Base, frozen=True, tag="adjust"):
    usage: _FastSignedUsage
    ref_event_id: _Ident | None = None


_DECODER = msgspec.json.Decoder(_Reserve | _Extend | _Commit | _Release | _Adjust)


class Event(Struct, frozen=True):
    """One valid usage event, as the fold needs it.

    ``usage`` has the attributes of :class:`schemas.events.Usage` (signed for ``adjust``;
    ``None`` for ``release``); ``occurred_ms``/``expires_ms`` are the exact, floored
    milliseconds of the models' ``occurred_ms``/``expires_ms``.
    """

    kind: Kind
    event_id: str
    subject: FastSubject | Subject
    occurred_ms: int
    usage: FastUsage | _FastSignedUsage | Usage | SignedUsage | None = None
    reservation_id: str | None = None
    expires_ms: int | None = None


def _micros(text: str) -> int | None:
    """Microseconds since the epoch of a time in the strict spelling, else ``None``."""
    if _TIME.fullmatch(text) is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return (moment - _EPOCH) // _ONE_US


def _fast(raw: bytes) -> Event | None:
    """The msgspec path; ``None`` when it cannot vouch for the record either way."""
    try:
        rec = _DECODER.decode(raw)
    except msgspec.DecodeError:  # ValidationError included
        return None
    occurred = _micros(rec.occurred_at)
    if occurred is None or occurred < 0:
        return None
    if isinstance(rec, _Reserve):
        expires = _micros(rec.expires_at)
        if expires is None or expires <= occurred:
            return None
        return Event(
            "reserve",
            rec.event_id,
            rec.subject,
            occurred // 1000,
            rec.usage,
            rec.reservation_id,
            expires // 1000,
        )
    if isinstance(rec, _Extend):
        return Event(
            "extend", rec.event_id, rec.subject, occurred // 1000, rec.usage, rec.reservation_id
        )
    if isinstance(rec, _Commit):
        return Event(
            "commit", rec.event_id, rec.subject, occurred // 1000, rec.usage, rec.reservation_id
        )
    if isinstance(rec, _Release):
        return Event(
            "release", rec.event_id, rec.subject, occurred // 1000, None, rec.reservation_id
        )
    return Event("adjust", rec.event_id, rec.subject, occurred // 1000, rec.usage)


def from_model(event: UsageEvent) -> Event:
    """The :class:`Event` of a validated model."""
    if isinstance(event, ReserveEvent):
        return Event(
            event.kind,
            event.event_id,
            event.subject,
            event.occurred_ms,
            event.usage,
            event.reservation_id,
            event.expires_ms,
        )
    if isinstance(event, ReleaseEvent):
        return Event(
            event.kind, event.event_id, event.subject, event.occurred_ms, None, event.reservation_id
        )
    if isinstance(event, AdjustEvent):
        return Event(event.kind, event.event_id, event.subject, event.occurred_ms, event.usage)
    return Event(
        event.kind,
        event.event_id,
        event.subject,
        event.occurred_ms,
        event.usage,
        event.reservation_id,
    )


def decode(raw: bytes) -> Event:
    """Validate one record from ``budget.usage`` as :func:`schemas.events.parse_event` does.

    Raises:
        pydantic.ValidationError: the record is not a valid event (``parse_event``'s error).
    """
    return _fast(raw) or from_model(parse_event(raw))
