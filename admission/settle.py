"""Commit and release: settle an open reservation once, then publish its event, acked."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from spendgate.admission.auth import Principal
from spendgate.admission.bodies import Accepted
from spendgate.admission.exceptions import (
    AlreadySettled,
    OutcomeUnknown,
    PublishUnavailable,
    StoreUnavailable,
    UnknownReservation,
)
from spendgate.admission.fallback import DegradedLedger, LocalReservation
from spendgate.admission.metrics import PUBLISH_OVERFLOW, SETTLEMENTS
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.store import BudgetStore
from spendgate.schemas.events import CommitEvent, ReleaseEvent, Subject, Usage
from spendgate.schemas.redis_values import Settled

__all__ = ["Settler"]


def _unknown(reservation_id: str) -> UnknownReservation:
    return UnknownReservation(f"no open reservation {reservation_id!r}", "reservation_id")


def _already(reservation_id: str, settled_as: str | None) -> AlreadySettled:
    return AlreadySettled(
        f"reservation {reservation_id!r} was already {settled_as}d", "reservation_id"
    )


class Settler:
    """Settle reservations: Redis's record marked once (or this process's own, for a
    reservation made while Redis was unreachable), then the event published and acked.

    Args:
        store: Redis access.
        publisher: where commit and release events go.
        ledger: the in-process reservations made without Redis.
    """

    def __init__(
        self, store: BudgetStore, publisher: UsagePublisher, ledger: DegradedLedger
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.ledger = ledger

    async def settle(self, reservation_id: str, usage: Usage | None, who: Principal) -> Accepted:
        """Publish the commit (with ``usage``) or release (without) of an open reservation.

        Raises:
            UnknownReservation: no such open reservation (404).
            AlreadySettled: it was settled the other way (409).
            Forbidden: ``who`` may not act for its tenant (403).
            PublishUnavailable: the publish buffer is full (503).
            OutcomeUnknown: Kafka did not ack in time; retrying is safe (503).
        """
        kind: Settled = "commit" if usage is not None else "release"
        own = self.ledger.reservations.get(reservation_id)
        subject: Subject | None = None
        try:
            subject = await self.store.reservation_subject(reservation_id)
        except StoreUnavailable:
            if own is None:
                raise
        if subject is None and own is None:
            raise _unknown(reservation_id)
        who.check((subject or own.subject).tenant, "reservation_id")  # type: ignore[union-attr]
        if not self.publisher.has_room():
            PUBLISH_OVERFLOW.labels(action="refused").inc()
            raise PublishUnavailable("the publish buffer is full (Kafka unreachable); retry")
        if subject is not None:
            await self._mark_in_redis(reservation_id, kind)
        else:
            assert own is not None
            subject = self._mark_own(reservation_id, own, kind)
        await self._publish(reservation_id, subject, usage, kind)
        return Accepted(reservation_id=reservation_id)

    async def _mark_in_redis(self, reservation_id: str, kind: Settled) -> None:
        settled = await self.store.settle(reservation_id, kind)
        if settled.status == "missing":
            raise _unknown(reservation_id)
        if settled.status == "conflict":
            raise _already(reservation_id, settled.settled_as)

    @staticmethod
    def _mark_own(reservation_id: str, own: LocalReservation, kind: Settled) -> Subject:
        if own.settled is not None and own.settled != kind:
            raise _already(reservation_id, own.settled)
        own.settled = kind
        return own.subject

    async def _publish(
        self, reservation_id: str, subject: Subject, usage: Usage | None, kind: Settled
    ) -> None:
        common: dict[str, Any] = {
            "subject": subject,
            "occurred_at": datetime.now(UTC),
            "reservation_id": reservation_id,
        }
        # The id derives from the reservation and the call, so a retry after a 503 (or a
        # lost answer) is the same event: the publisher never queues it twice, and the
        # worker dedupes a copy that reached the log from an earlier try.
        event = (
            CommitEvent(event_id=f"commit-{reservation_id}", usage=usage, **common)
            if usage is not None
            else ReleaseEvent(event_id=f"release-{reservation_id}", **common)
        )
        if not await self.publisher.publish_acked(event):
            SETTLEMENTS.labels(kind=kind, result="unknown").inc()
            raise OutcomeUnknown(
                f"Kafka did not acknowledge the {kind} of {reservation_id!r} in time: it may "
                "or may not be recorded; retrying the same call is safe (counted once)"
            )
        SETTLEMENTS.labels(kind=kind, result="acked").inc()
