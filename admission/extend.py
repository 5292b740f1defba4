"""``POST /v1/extend``: grow an open reservation on every budget it holds, or on none."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from spendgate.admission.auth import Principal
from spendgate.admission.bodies import ExtendRequest
from spendgate.admission.decide import Answer, Planner, statuses, worst
from spendgate.admission.exceptions import (
    AlreadySettled,
    OutcomeUnknown,
    PublishUnavailable,
    UnknownReservation,
    Unprocessable,
    Unvouched,
)
from spendgate.admission.metrics import EXTENDS, PUBLISH_OVERFLOW
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.store import BudgetStore
from spendgate.schemas.events import ExtendEvent, extend_event_id
from spendgate.schemas.exceptions import MissingGroupByField, UnitError
from spendgate.schemas.policies import Policy

__all__ = ["ExtendService"]

logger = logging.getLogger(__name__)


class ExtendService:
    """Decides extends: one script call over every budget key of the reservation's subject,
    then the ``extend`` event acked by Kafka before the 200 (as a commit's 202).

    Args:
        store: Redis access.
        publisher: where the extend event goes.
        planner: the planner of a list of policies (cached per policy version by the
            admit service).
    """

    def __init__(
        self,
        store: BudgetStore,
        publisher: UsagePublisher,
        planner: Callable[[list[Policy]], Planner],
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.planner = planner

    async def extend(self, body: ExtendRequest, who: Principal) -> Answer:
        """Grow ``body.reservation_id`` by ``body.add`` on every budget, or refuse (429).

        The keys are those the reservation's subject (the plan it was admitted on: a
        downgraded model, if it was downgraded) matches now, with no cap, downgrade or
        route alternative: an extend either fits everywhere or is refused.

        Raises:
            UnknownReservation: no open reservation with this id (404).
            AlreadySettled: it was committed or released (409).
            Unprocessable: ``add`` cannot be counted in a matching policy's unit (422).
            PublishUnavailable: the publish buffer is full (503, nothing grew).
            Unvouched: a key's window cannot be vouched for and its policy fails closed.
            OutcomeUnknown: Kafka did not ack the extend event in time (503; it grew in
                Redis; the same call again returns the same answer and republishes it).
            StoreUnavailable: Redis did not answer (503).
        """
        rid, seq = body.reservation_id, body.seq
        subject = await self.store.reservation_subject(rid)
        if subject is None:
            raise UnknownReservation(f"no open reservation {rid!r}", "reservation_id")
        who.check(subject.tenant, "reservation_id")
        planner = self.planner(await self.store.policies())
        try:
            charges = planner.charges(subject, body.add)
        except MissingGroupByField as exc:
            raise Unprocessable(str(exc), "reservation_id") from exc
        except UnitError as exc:
            raise Unprocessable(str(exc), "add") from exc
        if not self.publisher.has_room():
            PUBLISH_OVERFLOW.labels(action="refused").inc()
            raise PublishUnavailable("the publish buffer is full (Kafka unreachable); retry")
        entry = extend_event_id(rid, seq)
        result = await self.store.extend(entry, rid, seq, subject, charges)
        if result.outcome == "missing":
            raise UnknownReservation(f"no open reservation {rid!r}", "reservation_id")
        if result.outcome == "settled":
            raise AlreadySettled(f"reservation {rid!r} was already settled", "reservation_id")
        if result.outcome == "unvouched":
            EXTENDS.labels(decision="unvouched").inc()
            state = worst(result.keys) or "missing"
            raise Unvouched(
                f"the budget windows of reservation {rid!r} cannot be vouched for ({state}); "
                "nothing grew",
                state,
            )
        body_out: dict[str, Any] = {
            "decision": "allow" if result.outcome == "allow" else "reject",
            "reservation_id": rid,
            "seq": seq,
            "violated": [
                c.target.policy.id
                for c, k in zip(charges, result.keys, strict=True)
                if k.violated and c.target.policy.mode == "enforce"
            ],
            "budgets": statuses(charges, result.keys),
        }
        EXTENDS.labels(decision=body_out["decision"]).inc()
        if result.outcome == "reject":
            return Answer(429, body_out, {})
        event = ExtendEvent(
            event_id=entry,
            subject=subject,
            occurred_at=datetime.fromtimestamp(result.now_ms / 1000, UTC),
            reservation_id=rid,
            seq=seq,
            usage=body.add,
        )
        if not await self.publisher.publish_acked(event):
            raise OutcomeUnknown(
                f"Kafka did not acknowledge extend {seq} of {rid!r} in time: the reservation "
                "grew, its event may or may not be recorded; retrying the same call is safe "
                "(applied once, republished)"
            )
        return Answer(200, body_out, {})
