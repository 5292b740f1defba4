"""The admit path: one parse, one plan, one script round trip, one answer; reserve queued.

:class:`AdmitService` is the one admit implementation, around the pure decisions of
:mod:`admission.decide` and the one store call. ``POST /v1/admit`` has two entrances to
it. :class:`AdmitEndpoint` serves the path straight from ASGI in front of the FastAPI app:
it reads the body once, validates it once (pydantic on the bytes) and sends the answer
encoded once. A body it cannot validate goes on to the FastAPI route declared for the
same path (``admission.routes.admit``), so refusals (and their ``{error: ...}`` bodies)
are the framework's, byte for byte, and the OpenAPI document keeps describing the route;
a body the route then accepts is decided by the same ``AdmitService.admit``.

Why the fast path is kept (issue 28: only if a paired A/B shows it worth more than 5%):
``bench.admission_ab`` of this path against the same commit with the fast path taken out
(the route serves every admit), 6 rounds of 5 s, 1-budget ``reject`` policy, 2026-12-02.
Server CPU per request, fast / route-only, median (per-round range): 16 connections,
admitted 799 / 1,148 us = 0.708 (0.679-0.752), refused 577 / 890 us = 0.634
(0.608-0.691); 1 connection, admitted 1,275 / 1,595 us = 0.799 (0.772-0.819), refused
748 / 1,019 us = 0.731 (0.711-0.749). The route alone costs 25-58% more CPU per request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime

from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from spendgate.admission.auth import Authorizer, Principal
from spendgate.admission.decide import (
    AdmitResult,
    Answer,
    Charge,
    Plan,
    Planner,
    answer_of,
    fallback_answer,
    unvouched_of,
    worst,
)
from spendgate.admission.delay import Delays, Gone, Held, delay_of, waitable_ms
from spendgate.admission.exceptions import (
    AdmissionError,
    BadRequest,
    Overloaded,
    PublishUnavailable,
    StoreUnavailable,
    Unvouched,
)
from spendgate.admission.fallback import DegradedLedger, LocalReservation, strictest
from spendgate.admission.metrics import (
    CAPPED_NEXT,
    DECISIONS,
    FALLBACK_ADMITS,
    LATENCY,
    PUBLISH_OVERFLOW,
    UNVOUCHED,
)
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.refusals import NoRefusals, RefusalSink
from spendgate.admission.reserves import DEFAULT_TTL_MS, reserve_event
from spendgate.admission.store import BudgetStore
from spendgate.admission.wire import (
    error_content,
    error_headers,
    error_of,
    guard_problem,
    read_body,
    replaying,
    send_json,
)
from spendgate.schemas.decisions import AdmitRequest
from spendgate.schemas.events import ReleaseEvent, Subject, Usage, UsageEvent
from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.overage import factor_milli, scaled
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.refusals import Refusal

__all__ = ["AdmitEndpoint", "AdmitService", "bearer", "disconnected"]

logger = logging.getLogger(__name__)

_validate = AdmitRequest.model_validate_json


#: Requests an admission process holds at once for ``delay`` policies (``SPENDGATE_DELAY_WAITERS``).
DEFAULT_DELAY_WAITERS = 1000


async def disconnected(receive: Receive) -> None:
    """Return once the client disconnects (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def bearer(authorization: str | None) -> str | None:
    """``Bearer <credentials>`` as FastAPI's ``HTTPBearer(auto_error=False)`` reads the
    ``Authorization`` header, or None (no header, no credentials, another scheme)."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.partition(" ")
    credentials = credentials.strip()
    if not (scheme and credentials) or scheme.lower() != "bearer":
        return None
    return f"Bearer {credentials}"


class AdmitService:
    """Admit one request: plan, one store call, the answer; the reserve event queued.

    Args:
        store: Redis access.
        publisher: where reserve events go (never awaited here).
        prices: the price catalog for ``cost_usd`` policies.
        ledger: the in-process state used while Redis cannot decide.
        refusals: where every refusal goes (``budget.refusals``), never awaited.
        delays: the requests ``on_exceed: delay`` policies hold.
        key_ids: the secret subject fields' key ids: a request's raw values are replaced
            before anything is planned, stored, published or logged (none: kept as sent).
    """

    def __init__(
        self,
        store: BudgetStore,
        publisher: UsagePublisher,
        prices: PriceCatalog | None,
        ledger: DegradedLedger,
        refusals: RefusalSink | None = None,
        delays: Delays | None = None,
        key_ids: KeyIds | None = None,
    ) -> None:
        self.key_ids = key_ids
        self.store = store
        self.delays = delays if delays is not None else Delays(DEFAULT_DELAY_WAITERS)
        self.publisher = publisher
        self.prices = prices
        self.ledger = ledger
        self.refusals: RefusalSink = refusals if refusals is not None else NoRefusals()
        self._planner: Planner | None = None

    def planner(self, policies: Sequence[Policy]) -> Planner:
        """The planner of ``policies``, rebuilt only when the store read new ones."""
        planner = self._planner
        if planner is None or planner.policies is not policies:
            planner = self._planner = Planner(policies, self.prices)
        return planner

    def subject(self, subject: Subject) -> Subject:
        """``subject`` with its secret fields as key ids (as every request is decided).

        Raises:
            BadRequest: a secret field holds a key id made with another subject secret.
        """
        keys = self.key_ids
        if keys is None:
            return subject
        foreign = keys.foreign_field(subject)
        if foreign is not None:
            raise BadRequest(
                f"subject.{foreign} is a key id made with another subject secret than this "
                f"service's (sgk_{keys.fingerprint}_...): every client and service of a "
                "deployment must share SPENDGATE_SUBJECT_SECRET",
                field=f"subject.{foreign}",
            )
        return keys.subject(subject)

    def _protected(self, body: AdmitRequest) -> AdmitRequest:
        subject = self.subject(body.subject)
        return body if subject is body.subject else body.model_copy(update={"subject": subject})

    async def plans(self, body: AdmitRequest) -> list[Plan]:
        """The plans of a request under the policies in force."""
        policies = await self.store.policies()
        return self.planner(policies).plans(body.subject, body.estimate)

    async def admit(
        self,
        body: AdmitRequest,
        who: Principal,
        gone: Callable[[], Awaitable[None]] | None = None,
    ) -> Answer:
        """Decide ``body`` for ``who``.

        Args:
            body: the request.
            who: the caller.
            gone: resolves when the client disconnects (only a held request watches it).

        Raises:
            AdmissionError: answered as ``{error: ...}`` (403, 400, 422, 503 ...).
            Gone: the client disconnected while its request was held (nothing held).
        """
        started = time.perf_counter()
        try:
            who.check(body.subject.tenant)
            body = self._protected(body)
            plans = await self.plans(body)
            if self._planner is not None and self._planner.any_cap_next:
                body, plans = await self._cap_next(body, plans, self._planner)
            self._check_room(plans[0].charges)
            planner = self._planner
            if planner is not None and planner.any_delay:
                keys = delay_of(plans[0])
                if keys:
                    return await self._delayed(body, plans, keys, gone)
            try:
                result = await self.store.admit(
                    body.request_id,
                    uuid.uuid4().hex,
                    plans,
                    body.estimate.output_tokens,
                    estimate=body.estimate,
                )
            except StoreUnavailable as exc:
                return self._fallback(body, plans[0].charges, exc)
            return self._from_result(body, plans, result)
        except Overloaded:
            DECISIONS.labels(decision="overloaded").inc()
            raise
        finally:
            LATENCY.observe(time.perf_counter() - started)

    async def _cap_next(
        self, body: AdmitRequest, plans: list[Plan], planner: Planner
    ) -> tuple[AdmitRequest, list[Plan]]:
        """Scale the estimate by the largest ``overage: cap_next`` factor among the
        request's keys (``schemas.overage``); the plans and the reserve event then carry the
        scaled estimate. One MGET, only for requests matching such a policy; Redis
        unreachable: no scaling (the admit then follows the failure modes)."""
        charges = [c for c in plans[0].charges if c.target.policy.overage == "cap_next"]
        if not charges:
            return body, plans
        try:
            marks = await self.store.overage_marks(charges)
        except StoreUnavailable:
            return body, plans
        now_ms = int(time.time() * 1000)
        factor = max(
            factor_milli(mark, now_ms, c.target.policy.window_ms)
            for mark, c in zip(marks, charges, strict=True)
        )
        if factor <= 1000:
            return body, plans
        CAPPED_NEXT.inc()
        raw = body.estimate.model_dump(exclude_none=True)
        estimate = Usage.model_validate(scaled(raw, factor))
        body = body.model_copy(update={"estimate": estimate})
        return body, planner.plans(body.subject, estimate)

    async def _decide(self, body: AdmitRequest, plans: list[Plan]) -> AdmitResult:
        return await self.store.admit(
            body.request_id,
            uuid.uuid4().hex,
            plans,
            body.estimate.output_tokens,
            estimate=body.estimate,
        )

    async def _delayed(
        self,
        body: AdmitRequest,
        plans: list[Plan],
        keys: tuple[str, ...],
        gone: Callable[[], Awaitable[None]] | None,
    ) -> Answer:
        """Admit a request an ``on_exceed: delay`` policy may hold (``admission.delay``)."""
        arrived = time.monotonic()
        tenant, request_id = body.subject.tenant, body.request_id
        delays = self.delays
        first: AdmitResult | None = None
        try:
            if not delays.joinable(tenant, request_id) and not delays.has_waiters(keys):
                first = await self._decide(body, plans)
                allowed = waitable_ms(plans[0], first)
                retry = first.retry_after_ms
                if allowed is None or retry is None or retry > allowed:
                    return self._from_result(body, plans, first)
            held = Held(
                decide=lambda: self._decide(body, plans),
                finish=lambda result, held_ms, why: self._finish(body, plans, result, held_ms, why),
                release=lambda result: self._release(plans, result),
            )
            return await delays.hold(tenant, request_id, keys, plans[0], first, arrived, held, gone)
        except StoreUnavailable as exc:
            return self._fallback(body, plans[0].charges, exc)

    def _finish(
        self,
        body: AdmitRequest,
        plans: list[Plan],
        result: AdmitResult,
        held_ms: int,
        why: str | None,
    ) -> Answer:
        answer = self._from_result(body, plans, result)
        answer.body["delayed_ms"] = held_ms
        if why is not None:
            answer.body["reason"] = why
        return answer

    async def _release(self, plans: list[Plan], result: AdmitResult) -> None:
        """Release a reservation made for a client that disconnected meanwhile."""
        plan = plans[result.plan] if result.plan < len(plans) else plans[0]
        rid = result.reservation_id
        try:
            await self.store.settle(rid, "release")
        except AdmissionError as exc:
            logger.warning("release of %s (client gone) not recorded in Redis: %s", rid, exc)
        self._publish_or_fail(
            ReleaseEvent(
                event_id=f"release-{rid}",
                subject=plan.subject,
                occurred_at=datetime.now(UTC),
                reservation_id=rid,
            )
        )

    def _publish_or_fail(self, event: UsageEvent) -> None:
        if self.publisher.publish(event):
            return
        # Lost between the room check and here: Redis still holds the reservation as
        # pending, and lists its reserve as unpublished, so an admission process's sweeper
        # republishes it after the grace period (admission.sweeper).
        PUBLISH_OVERFLOW.labels(action="dropped").inc()
        logger.error("publish buffer full: %s dropped", event.event_id)

    def _refused(self, body: AdmitRequest, answer: Answer, now_ms: int) -> None:
        """Hand a refusal to ``budget.refusals`` (a repeated ``request_id`` too: readers
        count it once); never waits."""
        self.refusals.offer(
            Refusal(
                request_id=body.request_id,
                subject=body.subject,
                estimate=body.estimate,
                violated=answer.body.get("violated", []),
                at=datetime.fromtimestamp(now_ms / 1000, UTC),
            )
        )

    def _check_room(self, charges: Sequence[Charge]) -> None:
        if self.publisher.has_room():
            return
        if strictest([c.target.policy for c in charges]) == "closed":
            PUBLISH_OVERFLOW.labels(action="refused").inc()
            raise PublishUnavailable("the publish buffer is full (Kafka unreachable)")
        PUBLISH_OVERFLOW.labels(action="admitted").inc()

    def _from_result(self, body: AdmitRequest, plans: list[Plan], result: AdmitResult) -> Answer:
        if result.outcome == "unvouched":
            return self._unvouched(body, plans, result)
        answer = answer_of(result, plans, body.subject)
        if not result.replayed:
            state = worst(result.keys)
            if state is not None:
                UNVOUCHED.labels(state=state, mode="open").inc()
        DECISIONS.labels(decision=answer.decision).inc()
        if result.outcome == "reject":
            self._refused(body, answer, result.now_ms)
        if result.outcome != "reject" and not result.replayed and result.plan < len(plans):
            plan = plans[result.plan]
            # Built from the same values the script stored in the reservation record, so a
            # republished copy (admission.sweeper) is this event byte for byte.
            ttl_ms = max((c.target.policy.reservation_ttl_ms for c in plan.charges), default=0)
            self._publish_or_fail(
                reserve_event(
                    plan.subject,
                    body.estimate,
                    result.reservation_id,
                    result.now_ms,
                    ttl_ms,
                    result.max_output_tokens,
                )
            )
        return answer

    def _unvouched(self, body: AdmitRequest, plans: list[Plan], result: AdmitResult) -> Answer:
        """Answer a request the script would not decide: a window it depends on is not
        vouched for, and its policy fails closed (503) or degraded (this process's own
        allowance, as when Redis is unreachable)."""
        keys = unvouched_of(plans, result)
        if keys.closed:
            UNVOUCHED.labels(state=keys.state, mode="refused").inc()
            DECISIONS.labels(decision="error").inc()
            raise Unvouched(f"{keys.why}; policy {', '.join(keys.closed)} fails closed", keys.state)
        UNVOUCHED.labels(state=keys.state, mode="degraded").inc()
        return self._fallback(body, keys.blocking, StoreUnavailable(keys.why))

    def _fallback(
        self, body: AdmitRequest, charges: Sequence[Charge], why: StoreUnavailable
    ) -> Answer:
        """Answer without Redis, following the strictest failure mode of ``charges``."""
        remembered = (body.subject.tenant, body.request_id)
        previous = self.ledger.answers.get(remembered)
        if isinstance(previous, Answer):
            DECISIONS.labels(decision=previous.decision).inc()
            return previous
        rid = self.store.new_reservation_id(body.subject.tenant, uuid.uuid4().hex)
        now_ms = int(time.time() * 1000)
        outcome = fallback_answer(
            self.ledger, charges, body.subject.model, now_ms, rid, DEFAULT_TTL_MS
        )
        if outcome.answer is None:
            FALLBACK_ADMITS.labels(mode="closed", result="refused").inc()
            DECISIONS.labels(decision="error").inc()
            raise StoreUnavailable(
                f"{why.message}; policy {', '.join(outcome.closed)} fails closed", None
            ) from why
        answer = outcome.answer
        DECISIONS.labels(decision=answer.decision).inc()
        if not outcome.admitted:
            FALLBACK_ADMITS.labels(mode=outcome.mode, result="refused").inc()
            self._refused(body, answer, now_ms)
            return answer
        FALLBACK_ADMITS.labels(mode=outcome.mode, result="admitted").inc()
        self.ledger.reservations.put(rid, LocalReservation(body.subject))
        self._publish_or_fail(
            reserve_event(body.subject, body.estimate, rid, now_ms, outcome.ttl_ms)
        )
        self.ledger.answers.put(remembered, answer)
        return answer


class AdmitEndpoint:
    """``POST /v1/admit`` served from ASGI, in front of ``app`` (which serves the rest).

    Args:
        app: the FastAPI app; it also gets every admit body this path cannot validate.
        service: the admit logic.
        authorizer: bearer-token auth.
        max_body_bytes: larger bodies are refused with 413.
    """

    def __init__(
        self, app: ASGIApp, service: AdmitService, authorizer: Authorizer, max_body_bytes: int
    ) -> None:
        self.app = app
        self.service = service
        self.authorizer = authorizer
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/admit" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        length = content_type = ""
        authorization: str | None = None
        for name, value in scope["headers"]:
            low = name.lower()
            if low == b"content-length":
                length = value.decode("latin-1")
            elif low == b"content-type":
                content_type = value.decode("latin-1")
            elif low == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
        problem = guard_problem(length, content_type, self.max_body_bytes)
        if problem is None:
            raw = await read_body(receive, self.max_body_bytes)
            if raw is None:
                return
            if isinstance(raw, bytes):
                try:
                    body = _validate(raw)
                except ValidationError:
                    # The framework's route refuses it, with its own words and field.
                    await self.app(scope, replaying(raw, receive), send)
                    return
                await self._admit(body, authorization, send, receive)
                return
            problem = raw
        await send_json(send, problem.status, error_of(problem))

    async def _admit(
        self, body: AdmitRequest, authorization: str | None, send: Send, receive: Receive
    ) -> None:
        try:
            who = self.authorizer.principal(bearer(authorization))
            answer = await self.service.admit(body, who, lambda: disconnected(receive))
        except Gone:
            return  # nobody to answer; nothing was held for them
        except AdmissionError as exc:
            await send_json(send, exc.status, error_of(exc), error_headers(exc))
            return
        except Exception:
            logger.exception("internal error")
            await send_json(send, 500, error_content("internal", "internal error"))
            return
        await send_json(send, answer.status, answer.body, answer.headers)
