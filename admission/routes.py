"""The admission API's endpoints: plain functions over ``app.state.admission``.

Each endpoint reads what it needs from :class:`admission.state.AdmissionState` and hands
the work to the logic beside it (:class:`admission.admit.AdmitService`,
:class:`admission.settle.Settler`, :class:`admission.extend.ExtendService`,
:func:`admission.budgets.read_budgets`); errors are raised as
:class:`admission.exceptions.AdmissionError` and answered by :mod:`admission.handlers`.
``POST /v1/admit`` is mostly served by :class:`admission.admit.AdmitEndpoint` in front of
the app; the route here answers the bodies that path hands on, through the same
``AdmitService.admit``, and documents the endpoint in the OpenAPI document.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from spendgate.admission.admit import disconnected
from spendgate.admission.auth import Principal
from spendgate.admission.bodies import (
    Accepted,
    BudgetList,
    CommitRequest,
    ErrorBody,
    ExtendAnswer,
    ExtendRequest,
    ReleaseRequest,
)
from spendgate.admission.budgets import read_budgets, subject_of_query
from spendgate.admission.delay import Gone
from spendgate.admission.exceptions import Forbidden, Overloaded, StoreUnavailable
from spendgate.admission.handlers import error_response
from spendgate.admission.metrics import PUBLISH_BUFFER, REDIS_CALLS, SETTLE_LATENCY
from spendgate.admission.state import state_of
from spendgate.admission.status import StackStatus, read_status
from spendgate.admission.wire import encode_json
from spendgate.schemas.decisions import AdmitRequest, Decision

__all__ = ["api", "probes"]

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

_bearer = HTTPBearer(auto_error=False)

#: The ``/v1`` endpoints.
api = APIRouter(prefix="/v1")
#: Liveness, readiness and metrics.
probes = APIRouter()


async def principal(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),  # noqa: B008
) -> Principal:
    """The caller, from its bearer token (refused with 401 when auth is on and it has none)."""
    header = f"Bearer {credentials.credentials}" if credentials is not None else None
    return state_of(request).authorizer.principal(header)


Caller = Annotated[Principal, Depends(principal)]


def _json(status: int, content: Any, headers: dict[str, str] | None) -> Response:
    # Encoded as the fast path encodes it: both entrances answer the same bytes.
    return Response(encode_json(content), status, headers, media_type="application/json")


@api.post(
    "/admit",
    response_model=Decision,
    response_model_exclude_none=True,
    responses={429: {"model": Decision, "description": "Refused"}, **_ERRORS},
    summary="May this request run? Reserve its estimate on every matching budget.",
)
async def admit(request: Request, body: AdmitRequest, who: Caller) -> Response:
    # (No docstring: it would become the operation's OpenAPI description.) A body the
    # fast path (admission.admit.AdmitEndpoint) handed on: one the framework refuses,
    # with its own words, or one only its JSON reading accepts, decided the same way.
    try:
        answer = await state_of(request).admits.admit(
            body, who, lambda: disconnected(request.receive)
        )
    except Gone:
        return Response(status_code=499)  # nobody reads it; nothing was held for them
    return _json(answer.status, answer.body, answer.headers)


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
async def commit(request: Request, body: CommitRequest, who: Caller) -> Accepted:
    """Settle a reservation with its actual usage."""
    started = time.perf_counter()
    try:
        return await state_of(request).settler.settle(body.reservation_id, body.usage, who)
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
async def release(request: Request, body: ReleaseRequest, who: Caller) -> Accepted:
    """Settle a reservation with nothing to charge."""
    started = time.perf_counter()
    try:
        return await state_of(request).settler.settle(body.reservation_id, None, who)
    finally:
        SETTLE_LATENCY.observe(time.perf_counter() - started)


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
async def extend(request: Request, body: ExtendRequest, who: Caller) -> Response:
    """Grow an open reservation."""
    answer = await state_of(request).extender.extend(body, who)
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
    who: Caller,
    # Declared for the OpenAPI document and their bounds; read from the query itself.
    tenant: QueryValue = None,
    team: QueryValue = None,
    project: QueryValue = None,
    api_key: QueryValue = None,
    user: QueryValue = None,
    model: QueryValue = None,
    pool: QueryValue = None,
    env: QueryValue = None,
) -> BudgetList:
    """Every budget matching the subject of the query."""
    state = state_of(request)
    subject = state.admits.subject(subject_of_query(request.query_params.multi_items()))
    who.check_read(subject.tenant, "tenant")
    return await read_budgets(state.store, state.admits.planner, subject)


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
async def status(request: Request, who: Caller) -> StackStatus:
    """The partition marks the admit script depends on."""
    if not (who.operator or who.tenants is None):
        raise Forbidden("the stack's status covers every tenant: it needs an operator or '*' token")
    store = state_of(request).store
    return await store._call(
        "status", lambda: read_status(store.client, store.layout.control, store.staleness_ms)
    )


@probes.get("/healthz")
async def healthz() -> dict[str, str]:
    # The process answers. (Comments, not docstrings, on the probes: see admit.)
    return {"status": "ok"}


@probes.get("/readyz", responses={503: {"model": ErrorBody}})
async def readyz(request: Request) -> Response:
    # Redis answers (503 when not, or when this process is saturated).
    try:
        ok = await state_of(request).store.ping()
    except Overloaded as exc:
        return error_response(exc.status, exc.code, exc.message, headers={"Retry-After": "1"})
    except StoreUnavailable:
        ok = False
    if ok:
        return JSONResponse({"status": "ready"})
    return error_response(503, "store_unavailable", "Redis does not answer")


@probes.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(request: Request) -> Response:
    # Prometheus text exposition; the publish buffer and Redis call gauges read now.
    state = state_of(request)
    depth = getattr(state.publisher, "depth", None)
    if isinstance(depth, int):
        PUBLISH_BUFFER.set(depth)
    REDIS_CALLS.labels(state="running").set(state.store.backpressure.running)
    REDIS_CALLS.labels(state="waiting").set(state.store.backpressure.waiting)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
