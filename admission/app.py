"""The admission HTTP API: a thin shell around the policies, the store and the publisher.

Decisions (``POST /v1/admit``), over every policy matching the subject, in one Lua script:

* every key fits: ``allow``; only ``observe`` policies exceeded: ``observe_reject`` (200,
  everything reserved, ``violated`` and ``retry_after_seconds`` say what would have
  happened);
* an enforce policy with ``on_exceed: reject`` exceeded (or a cap/downgrade that cannot
  help): ``reject`` (429), nothing reserved anywhere;
* only ``cap`` policies exceeded: reserve with the largest output that fits every key,
  answered as ``max_output_tokens`` (see :func:`cap_terms` for each unit);
* a ``downgrade`` policy exceeded (and no reject): the same request with the model
  replaced by ``downgrade_to`` is checked against the policies matching that subject at
  that model's prices; it is never downgraded twice.

Redis unreachable: the strictest failure mode among the matching enforce policies wins
(closed > degraded > open); see :mod:`admission.fallback`. A saturated process (its queue
of Redis calls full, or a call held up by the event loop) answers 503 ``overloaded``
instead; see :mod:`admission.backpressure`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from admission.auth import Authorizer, Principal
from admission.bodies import Accepted, BudgetList, CommitRequest, ErrorBody, ReleaseRequest
from admission.exceptions import (
    AdmissionError,
    AlreadySettled,
    BadRequest,
    OutcomeUnknown,
    Overloaded,
    PayloadTooLarge,
    PublishUnavailable,
    StoreUnavailable,
    UnknownReservation,
    Unprocessable,
    UnsupportedMediaType,
    Unvouched,
)
from admission.fallback import DegradedLedger, LocalReservation, strictest
from admission.metrics import (
    DECISIONS,
    FALLBACK_ADMITS,
    LATENCY,
    PUBLISH_BUFFER,
    PUBLISH_OVERFLOW,
    REDIS_CALLS,
    SETTLE_LATENCY,
    SETTLEMENTS,
    UNVOUCHED,
)
from admission.publisher import UsagePublisher
from admission.reserves import DEFAULT_TTL_MS, reserve_event
from admission.store import AdmitResult, BudgetStore, CapTerms, Charge, KeyState, Plan
from schemas.decisions import AdmitRequest, BudgetStatus, Decision
from schemas.events import CommitEvent, ReleaseEvent, Subject, Usage
from schemas.exceptions import MissingGroupByField, UnitError
from schemas.matching import targets
from schemas.policies import Policy
from schemas.prices import PriceCatalog
from schemas.types import MAX_AMOUNT, SUBJECT_FIELDS
from schemas.units import amount

logger = logging.getLogger(__name__)

#: Largest request body accepted (admit bodies are a few hundred bytes).
DEFAULT_MAX_BODY_BYTES = 64 * 1024
#: Printable ASCII kept as is in the ``Spendgate-Model`` header; the rest is %-encoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
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
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    if state is not None:
        body["state"] = state
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def cap_terms(
    policy: Policy, estimate: Usage, prices: PriceCatalog | None, model: str | None
) -> CapTerms:
    """How a key's amount depends on the output tokens, for ``cap``.

    * ``output_tokens``: the output itself; ``total_tokens``: the input part of the
      estimate (cached input when the policy counts it) plus the output;
    * ``cost_usd`` priced from tokens: ``ceil((input cost + output * output rate) / 1e6)``
      in micro-USD at the model's (or default) rate, exactly as the stream processor
      prices the capped usage; an estimate carrying its own ``cost_usd_micros`` is fixed;
    * ``requests``, ``input_tokens``, ``gpu_seconds``: capping output cannot lower them,
      so a cap policy of such a unit that does not fit refuses like ``reject``.
    """
    match policy.unit:
        case "output_tokens":
            return CapTerms(0, 1, 1)
        case "total_tokens":
            cached = estimate.cached_input_tokens if policy.count_cached_input else 0
            return CapTerms(estimate.input_tokens + cached, 1, 1)
        case "cost_usd" if estimate.cost_usd_micros is None:
            price = prices.price_of(model) if prices is not None and model is not None else None
            if price is None and policy.unpriced == "charge_default" and prices is not None:
                price = prices.default
            if price is None or price.output_per_mtok_micros == 0:
                return CapTerms()
            fixed = (
                estimate.input_tokens * price.input_per_mtok_micros
                + estimate.cached_input_tokens * price.cached_rate_micros
            )
            rate = price.output_per_mtok_micros
            # The Lua side works in doubles: beyond 2**53 it could not be exact.
            if fixed + estimate.output_tokens * rate > MAX_AMOUNT:
                return CapTerms()
            return CapTerms(fixed, rate, 1_000_000)
        case _:
            return CapTerms()


def _charges(
    policies: list[Policy], subject: Subject, estimate: Usage, prices: PriceCatalog | None
) -> list[Charge]:
    out = []
    for target in targets(policies, subject):
        policy = target.policy
        out.append(
            Charge(
                target,
                amount(policy, estimate, prices, model=subject.model),
                cap_terms(policy, estimate, prices, subject.model),
            )
        )
    return out


def build_plans(
    policies: list[Policy], subject: Subject, estimate: Usage, prices: PriceCatalog | None
) -> list[Plan]:
    """Plan 0 is the request as sent; one more plan per distinct downgrade target.

    Raises:
        BadRequest: a matching policy groups by a field the subject lacks.
        Unprocessable: the estimate cannot be counted in a matching policy's unit.
    """
    try:
        first = _charges(policies, subject, estimate, prices)
    except MissingGroupByField as exc:
        raise BadRequest(str(exc), f"subject.{exc.field}") from exc
    except UnitError as exc:
        raise Unprocessable(str(exc), "estimate") from exc
    plans: list[Plan] = []
    alt_of: dict[str, int] = {}
    charges = []
    for charge in first:
        policy = charge.target.policy
        target = policy.downgrade_to
        if policy.mode == "enforce" and target is not None and target != subject.model:
            if target not in alt_of:
                alt_subject = subject.model_copy(update={"model": target})
                try:
                    alt = _charges(policies, alt_subject, estimate, prices)
                except (MissingGroupByField, UnitError) as exc:
                    logger.debug("no downgrade to %s: %s", target, exc)
                    alt_of[target] = 0
                else:
                    alt_of[target] = len(plans) + 1
                    plans.append(Plan(alt_subject, tuple(alt)))
            charge = dataclasses.replace(charge, alt=alt_of[target])
        charges.append(charge)
    return [Plan(subject, tuple(charges)), *plans]


def _seconds(ms: int) -> int:
    return math.ceil(ms / 1000)


def _statuses(charges: tuple[Charge, ...], keys: tuple[KeyState, ...]) -> list[BudgetStatus]:
    out = []
    for charge, state in zip(charges, keys, strict=True):
        p = charge.target.policy
        held = state.reserved + state.own
        out.append(
            BudgetStatus(
                policy=p.id,
                key=charge.target.key,
                unit=p.unit,
                limit=p.limit,
                used=state.used,
                reserved=held,
                remaining=max(0, p.limit - state.used - held),
                window_seconds=p.window_ms // 1000,
                reset_after_seconds=_seconds(state.reset_after_ms),
                state=None if state.state == "vouched" else state.state,
            )
        )
    return out


def _worst(states: list[KeyState]) -> Literal["missing", "stale"] | None:
    """The worst state among ``states`` (None when every window is vouched for)."""
    seen = {s.state for s in states}
    return "missing" if "missing" in seen else "stale" if "stale" in seen else None


def ratelimit_headers(budgets: list[BudgetStatus]) -> dict[str, str]:
    """``RateLimit-Policy`` / ``RateLimit`` (IETF httpapi draft) for the tightest budget."""
    if not budgets:
        return {}
    tight = min(budgets, key=lambda b: (b.remaining / b.limit, b.remaining, b.policy))
    return {
        "RateLimit-Policy": f'"{tight.policy}";q={tight.limit};w={tight.window_seconds}',
        "RateLimit": f'"{tight.policy}";r={tight.remaining};t={tight.reset_after_seconds}',
    }


def _json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class BodyGuard:
    """Refuse, before any parsing, bodies that are too large (413) or not JSON (415)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem: AdmissionError | None = None
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            problem = PayloadTooLarge(f"body of {length} bytes is over {self.max_body_bytes}")
        elif not _json_type(headers.get("content-type", "")):
            problem = UnsupportedMediaType(
                "send the body as JSON with Content-Type: application/json"
            )
        body = b""
        if problem is None:
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    problem = PayloadTooLarge(f"body is over {self.max_body_bytes} bytes")
                    break
        if problem is not None:
            response = _error(problem.status, problem.code, problem.message)
            await response(scope, receive, send)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def create_app(
    store: BudgetStore,
    publisher: UsagePublisher,
    prices: PriceCatalog | None = None,
    lifespan: Any = None,
    *,
    authorizer: Authorizer | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ledger: DegradedLedger | None = None,
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
    """
    auth = authorizer or Authorizer(None)
    local = ledger or DegradedLedger()
    app = FastAPI(
        title="spendgate admission",
        version="1",
        lifespan=lifespan,
        description=(
            "Rolling-window spend budgets: one atomic check-and-reserve over every "
            "matching policy. Errors are `{error: {code, message, field?}}`."
        ),
    )
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes)
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
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.status == 503:
            headers = {"Retry-After": "1"}
        state = exc.state if isinstance(exc, Unvouched) else None
        return _error(exc.status, exc.code, exc.message, exc.field, headers, state)

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

    def _publish_or_fail(event: Any, policies: list[Policy]) -> None:
        if publisher.publish(event):
            return
        # Lost between the room check and here: Redis still holds the reservation as
        # pending, and lists its reserve as unpublished, so an admission process's sweeper
        # republishes it after the grace period (admission.sweeper).
        PUBLISH_OVERFLOW.labels(action="dropped").inc()
        logger.error("publish buffer full: %s dropped", event.event_id)

    def _check_room(policies: list[Policy]) -> None:
        if publisher.has_room():
            return
        mode = strictest(policies)
        if mode == "closed":
            PUBLISH_OVERFLOW.labels(action="refused").inc()
            raise PublishUnavailable("the publish buffer is full (Kafka unreachable)")
        PUBLISH_OVERFLOW.labels(action="admitted").inc()

    def _answer(decision: Decision, status: int, extra: dict[str, str]) -> JSONResponse:
        headers = ratelimit_headers(decision.budgets)
        headers.update(extra)
        headers["Spendgate-Decision"] = decision.decision
        if decision.model is not None:
            # Header values are Latin-1 on the wire: a model name outside it is sent
            # percent-encoded (RFC 3986 style); the body carries it as sent.
            headers["Spendgate-Model"] = quote(decision.model, safe=_HEADER_SAFE)
        if decision.retry_after_seconds is not None and status == 429:
            headers["Retry-After"] = str(decision.retry_after_seconds)
        DECISIONS.labels(decision=decision.decision).inc()
        return JSONResponse(decision.model_dump(mode="json", exclude_none=True), status, headers)

    def _unvouched(body: AdmitRequest, plans: list[Plan], result: AdmitResult) -> JSONResponse:
        """Answer a request the script would not decide: a window it depends on is not
        vouched for, and its policy fails closed (503) or degraded (this process's own
        allowance, as when Redis is unreachable)."""
        blocking = [
            (c, k)
            for c, k in zip(plans[result.plan].charges, result.keys, strict=True)
            if k.state != "vouched"
            and c.target.policy.mode == "enforce"
            and c.target.policy.failure != "open"
        ]
        state = _worst([k for _, k in blocking]) or "missing"
        keys = ", ".join(c.target.key for c, _ in blocking)
        why = (
            f"budget state for {keys} is {state} in Redis ("
            + (
                "lost; the worker is restoring it"
                if state == "missing"
                else "its worker is dead or behind"
            )
            + ")"
        )
        closed = [c.target.policy.id for c, _ in blocking if c.target.policy.failure == "closed"]
        if closed:
            UNVOUCHED.labels(state=state, mode="refused").inc()
            DECISIONS.labels(decision="error").inc()
            raise Unvouched(f"{why}; policy {', '.join(sorted(set(closed)))} fails closed", state)
        UNVOUCHED.labels(state=state, mode="degraded").inc()
        return _fallback(body, plans, StoreUnavailable(why), [c for c, _ in blocking])

    def _from_result(body: AdmitRequest, plans: list[Plan], result: AdmitResult) -> JSONResponse:
        if result.outcome == "unvouched":
            return _unvouched(body, plans, result)
        plan = plans[result.plan] if result.plan < len(plans) else None
        if plan is None or len(plan.charges) != len(result.keys):
            # Replayed after the policies changed: the reservation stands, the per-key
            # view cannot be rebuilt.
            budgets: list[BudgetStatus] = []
            violated: list[str] = []
            model = body.subject.model
        else:
            budgets = _statuses(plan.charges, result.keys)
            violated = [
                c.target.policy.id
                for c, k in zip(plan.charges, result.keys, strict=True)
                if k.violated
            ]
            model = plan.subject.model
        retry_s = (
            None
            if result.never_fits or result.retry_after_ms is None
            else max(1, _seconds(result.retry_after_ms))
        )
        label: Literal["allow", "cap", "downgrade", "observe_reject", "reject"] = result.outcome
        state = _worst(list(result.keys))
        if state is not None and not result.replayed:
            UNVOUCHED.labels(state=state, mode="open").inc()
        if result.outcome != "reject" and result.plan > 0:
            label = "downgrade"
        decision = Decision(
            decision=label,
            reservation_id=None if result.outcome == "reject" else result.reservation_id,
            model=model,
            max_output_tokens=result.max_output_tokens,
            violated=violated,
            retry_after_seconds=retry_s,
            never_fits=result.never_fits,
            budgets=budgets,
            state=state,
        )
        if result.outcome == "reject":
            return _answer(decision, 429, {})
        if not result.replayed and plan is not None:
            # Built from the same values the script stored in the reservation record, so a
            # republished copy (admission.sweeper) is this event byte for byte.
            ttl_ms = max((c.target.policy.reservation_ttl_ms for c in plan.charges), default=0)
            _publish_or_fail(
                reserve_event(
                    plan.subject,
                    body.estimate,
                    result.reservation_id,
                    result.now_ms,
                    ttl_ms,
                    result.max_output_tokens,
                ),
                [c.target.policy for c in plan.charges],
            )
        return _answer(decision, 200, {})

    def _fallback(
        body: AdmitRequest,
        plans: list[Plan],
        why: StoreUnavailable,
        only: list[Charge] | None = None,
    ) -> JSONResponse:
        """Answer without Redis, following the strictest failure mode of the request's
        keys (or of ``only`` those: the keys whose window Redis cannot vouch for)."""
        previous = local.answers.get((body.subject.tenant, body.request_id))
        if previous is not None:
            return JSONResponse(previous[0], previous[1], previous[2])
        charges = tuple(only) if only is not None else plans[0].charges
        policies = [c.target.policy for c in charges]
        mode = strictest(policies)
        if mode == "closed":
            FALLBACK_ADMITS.labels(mode="closed", result="refused").inc()
            DECISIONS.labels(decision="error").inc()
            closed = [p.id for p in policies if p.mode == "enforce" and p.failure == "closed"]
            raise StoreUnavailable(
                f"{why.message}; policy {', '.join(closed)} fails closed", None
            ) from why
        now_ms = int(time.time() * 1000)
        budgets: list[BudgetStatus] = []
        if mode == "degraded":
            held = [
                c
                for c in charges
                if c.target.policy.mode == "enforce" and c.target.policy.failure == "degraded"
            ]
            wanted = [(c.target.policy, c.target.key, c.amount) for c in held]
            over = local.try_charge(wanted, now_ms)
            for c in held:
                p = c.target.policy
                allowance = local.allowance(p)
                spent = local.spent(p, c.target.key, now_ms)
                budgets.append(
                    BudgetStatus(
                        policy=p.id,
                        key=c.target.key,
                        unit=p.unit,
                        limit=max(1, allowance),
                        used=0,
                        reserved=spent,
                        remaining=max(0, allowance - spent),
                        window_seconds=p.window_ms // 1000,
                        reset_after_seconds=_seconds(local.window_left_ms(p, now_ms)),
                    )
                )
            if over:
                FALLBACK_ADMITS.labels(mode="degraded", result="refused").inc()
                refusing = [held[i].target.policy for i in over]
                wait = max(local.window_left_ms(p, now_ms) for p in refusing)
                never = any(held[i].amount > local.allowance(held[i].target.policy) for i in over)
                decision = Decision(
                    decision="reject",
                    violated=[p.id for p in refusing],
                    retry_after_seconds=None if never else max(1, _seconds(wait)),
                    never_fits=never,
                    budgets=budgets,
                    model=body.subject.model,
                )
                return _answer(decision, 429, {"Spendgate-Fallback": mode})
        FALLBACK_ADMITS.labels(mode=mode, result="admitted").inc()
        rid = uuid.uuid4().hex
        ttl_ms = max((p.reservation_ttl_ms for p in policies), default=DEFAULT_TTL_MS)
        local.reservations.put(rid, LocalReservation(body.subject))
        _publish_or_fail(reserve_event(body.subject, body.estimate, rid, now_ms, ttl_ms), policies)
        decision = Decision(
            decision="allow", reservation_id=rid, model=body.subject.model, budgets=budgets
        )
        response = _answer(decision, 200, {"Spendgate-Fallback": mode})
        local.answers.put(
            (body.subject.tenant, body.request_id),
            (decision.model_dump(mode="json", exclude_none=True), 200, dict(response.headers)),
        )
        return response

    @api.post(
        "/admit",
        response_model=Decision,
        response_model_exclude_none=True,
        responses={429: {"model": Decision, "description": "Refused"}, **_ERRORS},
        summary="May this request run? Reserve its estimate on every matching budget.",
    )
    async def admit(body: AdmitRequest, who: Principal = Depends(principal)) -> Response:  # noqa: B008
        started = time.perf_counter()
        try:
            who.check(body.subject.tenant)
            policies = await store.policies()
            plans = build_plans(policies, body.subject, body.estimate, prices)
            _check_room([c.target.policy for c in plans[0].charges])
            try:
                result = await store.admit(
                    body.request_id,
                    uuid.uuid4().hex,
                    plans,
                    body.estimate.output_tokens,
                    estimate=body.estimate,
                )
            except StoreUnavailable as exc:
                return _fallback(body, plans, exc)
            return _from_result(body, plans, result)
        except Overloaded:
            DECISIONS.labels(decision="overloaded").inc()
            raise
        finally:
            LATENCY.observe(time.perf_counter() - started)

    async def _settle(reservation_id: str, usage: Usage | None, who: Principal) -> Accepted:
        """Publish the commit (with usage) or release (without) of an open reservation."""
        kind = "commit" if usage is not None else "release"
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
        who.check(subject.tenant, "tenant")
        policies = await store.policies()
        # A zero estimate with a zero cost: reading never needs a price.
        plans = build_plans(policies, subject, Usage(cost_usd_micros=0), prices)[:1]
        plans = [Plan(subject, tuple(dataclasses.replace(c, alt=0) for c in plans[0].charges))]
        result = await store.admit("", uuid.uuid4().hex, plans, 0, read_only=True)
        return BudgetList(budgets=_statuses(plans[0].charges, result.keys))

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


__all__ = ["BodyGuard", "build_plans", "cap_terms", "create_app", "ratelimit_headers"]
