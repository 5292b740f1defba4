"""The admission HTTP API: thin routes around the decisions, the store and the publisher.

``POST /v1/admit`` is served by :class:`admission.admit.AdmitEndpoint` in front of this
FastAPI app (one parse, one plan, one script round trip, one answer); the route declared
here documents it in the OpenAPI document and answers the bodies that path refuses, with
the framework's validation errors. What a decision is lives in :mod:`admission.decide`,
Redis behind :mod:`admission.store`. A saturated process (its queue of Redis calls full,
or a call held up by the event loop) answers 503 ``overloaded``; see
:mod:`admission.backpressure`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from spendgate.admission.admit import DEFAULT_DELAY_WAITERS, AdmitEndpoint, AdmitService
from spendgate.admission.auth import Authorizer, Principal
from spendgate.admission.bodies import (
    Accepted,
    BudgetList,
    CommitRequest,
    ErrorBody,
    ExtendAnswer,
    ExtendRequest,
    ReleaseRequest,
)
from spendgate.admission.decide import (
    Plan,
    Planner,
    build_plans,
    cap_terms,
    ratelimit_headers,
    statuses,
)
from spendgate.admission.delay import Delays
from spendgate.admission.exceptions import (
    AdmissionError,
    AlreadySettled,
    BadRequest,
    Forbidden,
    OutcomeUnknown,
    Overloaded,
    PublishUnavailable,
    StoreUnavailable,
    UnknownReservation,
)
from spendgate.admission.extend import ExtendService
from spendgate.admission.fallback import DegradedLedger
from spendgate.admission.metrics import (
    PUBLISH_BUFFER,
    PUBLISH_OVERFLOW,
    REDIS_CALLS,
    SETTLE_LATENCY,
    SETTLEMENTS,
)
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.refusals import RefusalSink
from spendgate.admission.status import StackStatus, read_status
from spendgate.admission.store import BudgetStore
from spendgate.admission.wire import BodyGuard, error_content, error_headers, error_of
from spendgate.schemas.decisions import AdmitRequest, Decision
from spendgate.schemas.events import CommitEvent, ReleaseEvent, Subject, Usage
from spendgate.schemas.forecast import forecast
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.redis_values import Settled
from spendgate.schemas.types import SUBJECT_FIELDS
from spendgate.schemas.windows import WindowSpec

logger = logging.getLogger(__name__)

#: Largest request body accepted (admit bodies are a few hundred bytes).
DEFAULT_MAX_BODY_BYTES = 64 * 1024
#: A subject field given as a query parameter (as ``schemas.types.SubjectValue``).
QueryValue = Annotated[str | None, Query(min_length=1, max_length=200)]

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in {
        400: "Invalid body or query (names the field)",
        401: "Missing or unknown bearer token",
        403: "The token may not act for this tenant",
        413: "Body too large",
        415: "Body is not JSON",
        422: "Usage cannot be counted (for example an unpriced model)",
        503: (
            "Redis or Kafka unreachable and the policy fails closed; `overloaded`: this "
            "process is saturated (not a Redis failure); for commit and release: Kafka did "
            "not ack in time, outcome unknown, retry safe (Retry-After)"
        ),
    }.items()
}


def _error(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    state: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_content(code, message, field, state), status_code=status, headers=headers
    )


class AdmissionAPI(FastAPI):
    """The FastAPI app with ``POST /v1/admit`` served in front of its middleware stack."""

    admit_endpoint: dict[str, Any]

    def build_middleware_stack(self) -> ASGIApp:
        """The framework's stack, behind :class:`admission.admit.AdmitEndpoint`."""
        return AdmitEndpoint(super().build_middleware_stack(), **self.admit_endpoint)


def create_app(
    store: BudgetStore,
    publisher: UsagePublisher,
    prices: PriceCatalog | None = None,
    lifespan: Any = None,
    *,
    authorizer: Authorizer | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ledger: DegradedLedger | None = None,
    refusals: RefusalSink | None = None,
    delay_waiters: int = DEFAULT_DELAY_WAITERS,
) -> FastAPI:
    """Build the API around an opened store and publisher (see ``admission.server``).

    Args:
        store: Redis access.
        publisher: where reserve/commit/release events go.
        prices: the price catalog for ``cost_usd`` policies.
        lifespan: opens and closes the resources (``admission.server``).
        authorizer: bearer-token auth; ``None`` turns auth off.
        max_body_bytes: larger bodies are refused with 413.
        ledger: the in-process state used while Redis is unreachable.
        refusals: where refused admissions are published (``budget.refusals``).
        delay_waiters: how many requests ``delay`` policies may hold at once.
    """
    auth = authorizer or Authorizer(None)
    local = ledger or DegradedLedger()
    service = AdmitService(store, publisher, prices, local, refusals, Delays(delay_waiters))
    app = AdmissionAPI(
        title="spendgate admission",
        version="1",
        lifespan=lifespan,
        description=(
            "Rolling-window spend budgets: one atomic check-and-reserve over every "
            "matching policy. Errors are `{error: {code, message, field?}}`."
        ),
    )
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes)
    app.admit_endpoint = {
        "service": service,
        "authorizer": auth,
        "max_body_bytes": max_body_bytes,
    }
    bearer = HTTPBearer(auto_error=False)

    async def principal(
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> Principal:
        header = f"Bearer {credentials.credentials}" if credentials is not None else None
        return auth.principal(header)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return _error(400, "invalid_json", f"body is not valid JSON: {first['msg']}")
        loc = [str(p) for p in first["loc"] if p not in ("body", "query")]
        field = ".".join(loc) or None
        return _error(400, "invalid_request", f"{field or 'body'}: {first['msg']}", field)

    @app.exception_handler(AdmissionError)
    async def _admission_error(_: Request, exc: AdmissionError) -> JSONResponse:
        return JSONResponse(error_of(exc), exc.status, error_headers(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers) if exc.headers else None
        return _error(exc.status_code, code, str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return _error(500, "internal", "internal error")

    api = APIRouter(prefix="/v1")

    @api.post(
        "/admit",
        response_model=Decision,
        response_model_exclude_none=True,
        responses={429: {"model": Decision, "description": "Refused"}, **_ERRORS},
        summary="May this request run? Reserve its estimate on every matching budget.",
    )
    async def admit(body: AdmitRequest, who: Principal = Depends(principal)) -> Response:  # noqa: B008
        # Bodies the fast path (admission.admit.AdmitEndpoint) validated never get here;
        # this route answers the others: the framework's refusals, or a body only the
        # framework's JSON reading accepts, decided the same way.
        answer = await service.admit(body, who)
        return JSONResponse(answer.body, answer.status, answer.headers)

    async def _settle(reservation_id: str, usage: Usage | None, who: Principal) -> Accepted:
        """Publish the commit (with usage) or release (without) of an open reservation."""
        kind: Settled = "commit" if usage is not None else "release"
        own = local.reservations.get(reservation_id)
        subject: Subject | None = None
        try:
            subject = await store.reservation_subject(reservation_id)
        except StoreUnavailable:
            if own is None:
                raise
        if subject is None and own is None:
            raise UnknownReservation(f"no open reservation {reservation_id!r}", "reservation_id")
        who.check((subject or own.subject).tenant, "reservation_id")  # type: ignore[union-attr]
        if not publisher.has_room():
            PUBLISH_OVERFLOW.labels(action="refused").inc()
            raise PublishUnavailable("the publish buffer is full (Kafka unreachable); retry")
        if subject is not None:
            settled = await store.settle(reservation_id, kind)
            if settled.status == "missing":
                raise UnknownReservation(
                    f"no open reservation {reservation_id!r}", "reservation_id"
                )
            if settled.status == "conflict":
                raise AlreadySettled(
                    f"reservation {reservation_id!r} was already {settled.settled_as}d",
                    "reservation_id",
                )
        else:
            assert own is not None
            if own.settled is not None and own.settled != kind:
                raise AlreadySettled(
                    f"reservation {reservation_id!r} was already {own.settled}d",
                    "reservation_id",
                )
            own.settled = kind
            subject = own.subject
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
        if not await publisher.publish_acked(event):
            SETTLEMENTS.labels(kind=kind, result="unknown").inc()
            raise OutcomeUnknown(
                f"Kafka did not acknowledge the {kind} of {reservation_id!r} in time: it may "
                "or may not be recorded; retrying the same call is safe (counted once)"
            )
        SETTLEMENTS.labels(kind=kind, result="acked").inc()
        return Accepted(reservation_id=reservation_id)

    @api.post(
        "/commit",
        status_code=202,
        response_model=Accepted,
        responses={404: {"model": ErrorBody}, 409: {"model": ErrorBody}, **_ERRORS},
        summary="Charge the actual usage of a reservation (replaces its estimate).",
        description=(
            "202 once Kafka acknowledged the commit event (it is in the log). 503 "
            "`outcome_unknown` with Retry-After when no ack came in time: send the same call "
            "again; its event id derives from the reservation, so it is counted once."
        ),
    )
    async def commit(body: CommitRequest, who: Principal = Depends(principal)) -> Accepted:  # noqa: B008
        started = time.perf_counter()
        try:
            return await _settle(body.reservation_id, body.usage, who)
        finally:
            SETTLE_LATENCY.observe(time.perf_counter() - started)

    @api.post(
        "/release",
        status_code=202,
        response_model=Accepted,
        responses={404: {"model": ErrorBody}, 409: {"model": ErrorBody}, **_ERRORS},
        summary="Free a reservation that generated nothing.",
        description=(
            "202 once Kafka acknowledged the release event; 503 `outcome_unknown` with "
            "Retry-After when no ack came in time (retrying is safe, counted once)."
        ),
    )
    async def release(body: ReleaseRequest, who: Principal = Depends(principal)) -> Accepted:  # noqa: B008
        started = time.perf_counter()
        try:
            return await _settle(body.reservation_id, None, who)
        finally:
            SETTLE_LATENCY.observe(time.perf_counter() - started)

    extender = ExtendService(store, publisher, service.planner)

    @api.post(
        "/extend",
        response_model=ExtendAnswer,
        responses={
            429: {"model": ExtendAnswer, "description": "Nothing grew: a budget refused"},
            404: {"model": ErrorBody},
            409: {"model": ErrorBody},
            **_ERRORS,
        },
        summary="Grow an open reservation (a streaming response) on every budget, or on none.",
        description=(
            "200 once the reservation grew on every budget it holds and Kafka acknowledged "
            "the `extend` event; 429 when a budget refused (nothing grew; `budgets` say what "
            "remains): stop the generation. The same `seq` again returns the first answer "
            "and grows nothing twice. 503 `outcome_unknown`: retry the same call."
        ),
    )
    async def extend(body: ExtendRequest, who: Principal = Depends(principal)) -> Response:  # noqa: B008
        answer = await extender.extend(body, who)
        return JSONResponse(answer.body, answer.status, answer.headers)

    @api.get(
        "/budgets",
        response_model=BudgetList,
        responses=_ERRORS,
        summary="Every budget matching a subject; reserves nothing.",
        description=(
            "Subject fields as query parameters; free labels as `labels.NAME=value`. "
            "Unknown parameters are refused."
        ),
    )
    async def budgets(
        request: Request,
        who: Principal = Depends(principal),  # noqa: B008
        tenant: QueryValue = None,
        team: QueryValue = None,
        project: QueryValue = None,
        api_key: QueryValue = None,
        user: QueryValue = None,
        model: QueryValue = None,
        pool: QueryValue = None,
        env: QueryValue = None,
    ) -> BudgetList:
        fields: dict[str, Any] = {}
        labels: dict[str, str] = {}
        for name, value in request.query_params.multi_items():
            if name in SUBJECT_FIELDS:
                fields[name] = value
            elif name.startswith("labels.") and len(name) > len("labels."):
                labels[name.removeprefix("labels.")] = value
            else:
                raise BadRequest(f"unknown query parameter {name!r}", name)
        try:
            subject = Subject.model_validate({**fields, "labels": labels})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise BadRequest(f"{where}: {first['msg']}", where) from exc
        who.check_read(subject.tenant, "tenant")
        planner = service.planner(await store.policies())
        # A zero estimate with a zero cost: reading never needs a price.
        plan = planner.plans(subject, Usage(cost_usd_micros=0))[0]
        plans = [Plan(subject, tuple(dataclasses.replace(c, alt=0) for c in plan.charges))]
        result = await store.admit("", uuid.uuid4().hex, plans, 0, read_only=True)
        charges = plans[0].charges
        held = await store.buckets([(c.target.key, c.target.policy.bucket_ms) for c in charges])
        ahead = [
            forecast(
                WindowSpec(p.window_ms, p.bucket_ms, p.boundary), b, result.now_ms, limit=p.limit
            ).exhausts_in_seconds
            for p, b in zip((c.target.policy for c in charges), held, strict=True)
        ]
        return BudgetList.model_validate({"budgets": statuses(charges, result.keys, ahead)})

    @api.get(
        "/status",
        response_model=StackStatus,
        responses={
            401: _ERRORS[401],
            403: _ERRORS[403],
            503: {
                "model": ErrorBody,
                "description": "Redis does not answer (`store_unavailable`), or this process "
                "is saturated (`overloaded`)",
            },
        },
        summary="Can the stack decide? Every partition mark: vouched, stale or missing.",
        description=(
            "Per partition mark of the worker's topology (`usage:<p>`, `keyed:<p>`): its "
            "state as the admit script classifies it (missing: no mark; stale: the "
            "watermark is older than `staleness_ms` on the Redis clock; else vouched), the "
            "watermark and its age, the worker's last reported lag and the mark's fencing "
            "token. `decidable`: every mark vouched. 200 whenever Redis answers (read "
            "`decidable`); 503 when it does not. Needs a token that reads every tenant "
            "(`operator` or `*`): the marks describe every tenant's partitions."
        ),
    )
    async def status(who: Principal = Depends(principal)) -> StackStatus:  # noqa: B008
        if not (who.operator or who.tenants is None):
            raise Forbidden(
                "the stack's status covers every tenant: it needs an operator or '*' token"
            )
        return await store._call(
            "status", lambda: read_status(store.client, store.prefix, store.staleness_ms)
        )

    app.include_router(api)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"model": ErrorBody}})
    async def readyz() -> Response:
        try:
            ok = await store.ping()
        except Overloaded as exc:
            return _error(exc.status, exc.code, exc.message, headers={"Retry-After": "1"})
        except StoreUnavailable:
            ok = False
        if ok:
            return JSONResponse({"status": "ready"})
        return _error(503, "store_unavailable", "Redis does not answer")

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics() -> Response:
        depth = getattr(publisher, "depth", None)
        if isinstance(depth, int):
            PUBLISH_BUFFER.set(depth)
        REDIS_CALLS.labels(state="running").set(store.backpressure.running)
        REDIS_CALLS.labels(state="waiting").set(store.backpressure.waiting)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = [
    "AdmissionAPI",
    "BodyGuard",
    "Planner",
    "build_plans",
    "cap_terms",
    "create_app",
    "ratelimit_headers",
]
