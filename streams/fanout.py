"""Pure first stage: validate one raw usage record and split it per budget key."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError

from spendgate.schemas.events import UsageEvent, parse_event
from spendgate.schemas.exceptions import SpendgateError
from spendgate.schemas.matching import targets
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.streams.dedupe import IdStore, Position, event_digest, settled_digest
from spendgate.streams.ledger import KeyedRecord, keyed_record


@dataclass(frozen=True, slots=True)
class Fanout:
    """What one raw record becomes: keyed records, and reasons to dead-letter it."""

    kind: str | None = None
    records: list[KeyedRecord] = field(default_factory=list)
    #: Set when the whole record is refused (it changes nothing).
    rejected: str | None = None
    #: Per-policy problems (the other policies still count the event).
    partial: list[str] = field(default_factory=list)
    clamped: bool = False
    #: A producer duplicate within the dedupe horizon (it changes nothing).
    duplicate: bool = False


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


def fan_out(
    raw: bytes,
    *,
    broker_ms: int,
    policies: Iterable[Policy],
    prices: PriceCatalog | None,
    max_future_skew_ms: int,
    src: Position,
    ids: IdStore | None = None,
) -> Fanout:
    """Validate ``raw`` and build its record for every matching policy's budget key.

    ``occurred_at`` more than ``max_future_skew_ms`` after the broker timestamp is clamped
    to the broker timestamp (``clamped``). With ``ids``, a producer duplicate of an event
    seen within the horizon yields ``duplicate`` and no records, and settlements are
    remembered so a ``reserve`` arriving after its own commit or release charges nothing.
    """
    try:
        event = parse_event(raw)
        matched = targets(policies, event.subject)
    except ValidationError as exc:
        return Fanout(rejected=invalid_reason(exc))
    except SpendgateError as exc:
        return Fanout(kind=None, rejected=str(exc))
    duplicate, settled = note(ids, src, event) if ids is not None else (False, False)
    if duplicate:
        return Fanout(kind=event.kind, duplicate=True)
    clamped = event.occurred_ms > broker_ms + max_future_skew_ms
    occurred_ms = broker_ms if clamped else event.occurred_ms
    out = Fanout(kind=event.kind, clamped=clamped)
    for target in matched:
        try:
            out.records.append(
                keyed_record(
                    event,
                    target,
                    src_partition=src.partition,
                    src_offset=src.offset,
                    prices=prices,
                    occurred_ms=occurred_ms,
                    settled=settled,
                )
            )
        except SpendgateError as exc:
            out.partial.append(f"policy {target.policy.id}: {exc}")
    return out
