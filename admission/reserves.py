"""The ``reserve`` event of a reservation, built the same way on admit and from Redis."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

from spendgate.schemas.events import ReserveEvent, Subject, Usage
from spendgate.schemas.redis_values import ReservationRecord

__all__ = [
    "DEFAULT_TTL_MS",
    "IDEMPOTENCY_TTL_MS",
    "RECORD_GRACE_MS",
    "reserve_event",
    "reserve_event_from_record",
]

#: A reservation held by no policy with a TTL expires after this (15 min).
DEFAULT_TTL_MS = 900_000
#: How long a request id is remembered for idempotent repeats (>= any reservation TTL).
IDEMPOTENCY_TTL_MS = 24 * 3_600_000
#: A reservation record outlives its longest TTL by this, so a late commit still finds it.
RECORD_GRACE_MS = 3_600_000


def reserve_event(
    subject: Subject,
    estimate: Usage,
    reservation_id: str,
    at_ms: int,
    ttl_ms: int,
    max_output_tokens: int | None = None,
) -> ReserveEvent:
    """The reserve event of a reservation made at ``at_ms`` (Redis clock).

    Its id derives from the reservation, so a republished copy is the same event to the
    worker's dedupe.

    Args:
        subject: the subject of the reserved plan (after a downgrade: its model).
        estimate: the estimate as sent; ``max_output_tokens`` replaces its output tokens.
        reservation_id: the reservation.
        at_ms: the admission instant in ms since the epoch.
        ttl_ms: the longest reservation TTL of the reserved plan; 0 means
            :data:`DEFAULT_TTL_MS`.
        max_output_tokens: the capped output, or None when not capped.

    Returns:
        The event, equal (and equal in JSON) for equal arguments.
    """
    if max_output_tokens is not None:
        estimate = estimate.model_copy(update={"output_tokens": max_output_tokens})
    now = datetime.fromtimestamp(at_ms / 1000, UTC)
    return ReserveEvent(
        event_id=f"reserve-{reservation_id}",
        subject=subject,
        occurred_at=now,
        reservation_id=reservation_id,
        usage=estimate,
        expires_at=now + timedelta(milliseconds=ttl_ms or DEFAULT_TTL_MS),
    )


def reserve_event_from_record(
    reservation_id: str, record: Mapping[bytes, bytes] | Mapping[str, str]
) -> ReserveEvent | None:
    """Rebuild the reserve event from the reservation record the admit script wrote.

    Args:
        reservation_id: the reservation.
        record: the fields of its hash (``schemas.redis_values.ReservationRecord``).

    Returns:
        The same event the admit path published (same id, same JSON), or None when the
        record is gone (expired) or predates the fields the event is rebuilt from.
    """
    found = ReservationRecord.decode(record)
    if found is None:
        return None
    return reserve_event(
        Subject.model_validate_json(found.subject_json),
        Usage.model_validate_json(found.usage_json),
        reservation_id,
        found.at_ms,
        found.ttl_ms,
        found.max_output_tokens,
    )
