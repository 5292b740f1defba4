"""Producer-duplicate checks shared by the live fold and the dedupe rebuild (``streams.dedupe``)."""

from __future__ import annotations

from pydantic import ValidationError

from spendgate.schemas.events import UsageEvent
from spendgate.streams.dedupe import IdStore, Position, event_digest, settled_digest

__all__ = ["invalid_reason", "note", "note_ids"]


def invalid_reason(exc: ValidationError) -> str:
    """The dead-letter reason of a record the models refuse (the first five errors)."""
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "record"
        parts.append(f"{where}: {err['msg']}")
    return "invalid event: " + "; ".join(parts)


def note(ids: IdStore, src: Position, event: UsageEvent) -> tuple[bool, bool]:
    """Check one valid event against the id set and remember what it settles.

    Returns:
        ``(duplicate, settled)``: whether it is a producer duplicate within the horizon,
        and, for a ``reserve``, whether its reservation was settled before it arrived.
    """
    rid = getattr(event, "reservation_id", None)
    return note_ids(ids, src, event.subject.tenant, event.event_id, event.kind, rid)


def note_ids(
    ids: IdStore,
    src: Position,
    tenant: str | None,
    event_id: str,
    kind: str,
    reservation_id: str | None,
) -> tuple[bool, bool]:
    """:func:`note` on an event's parts (the fold's decoded events are not the models)."""
    if ids.check(src, event_digest(tenant, event_id)) == "duplicate":
        return True, False
    if reservation_id is None:
        return False, False
    mark = settled_digest(tenant, reservation_id)
    if kind in ("reserve", "extend"):
        # A reserve or extend arriving after its reservation settled charges nothing.
        return False, ids.seen_before(src, mark)
    ids.remember(src, mark)
    return False, False
