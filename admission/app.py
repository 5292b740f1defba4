"""The admission HTTP API: a thin shell around the policies, the store and the publisher."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict

from admission.exceptions import AdmissionError, BadRequest, UnknownReservation, Unprocessable
from admission.publisher import UsagePublisher
from admission.store import AdmitResult, BudgetStore, Charge
from schemas.decisions import AdmitRequest, BudgetStatus, Decision
from schemas.events import CommitEvent, ReleaseEvent, ReserveEvent, Subject, Usage
from schemas.exceptions import MissingGroupByField, UnitError
from schemas.matching import targets
from schemas.prices import PriceCatalog
from schemas.redis_keys import reservation_key
from schemas.types import Identifier
from schemas.units import amount

logger = logging.getLogger(__name__)

DECISIONS = Counter("spendgate_admission_decisions_total", "Admission answers.", ["decision"])
LATENCY = Histogram(
    "spendgate_admission_seconds",
    "Time to answer an admit.",
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)


class CommitRequest(BaseModel):
    """``POST /v1/commit``: the actual usage of a reserved request."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    reservation_id: Identifier
    usage: Usage


class ReleaseRequest(BaseModel):
    """``POST /v1/release``: the request ended with nothing to charge."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    reservation_id: Identifier


def _error(status: int, code: str, message: str, field: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    return JSONResponse({"error": body}, status_code=status)


def _now(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _statuses(charges: Sequence[Charge], result: AdmitResult) -> list[BudgetStatus]:
    out = []
    for charge, used, reserved in zip(charges, result.used, result.reserved, strict=True):
        p = charge.target.policy
        out.append(
            BudgetStatus(
                policy=p.id,
                key=charge.target.key,
                unit=p.unit,
                limit=p.limit,
                used=used,
                reserved=reserved,
                remaining=max(0, p.limit - used - reserved),
                window_seconds=p.window_ms // 1000,
                # Upper bound: with no new usage everything counted now has aged out by then.
                reset_after_seconds=p.window_ms // 1000,
            )
        )
    return out


def _ratelimit_headers(budgets: list[BudgetStatus]) -> dict[str, str]:
    if not budgets:
        return {}
    tight = min(budgets, key=lambda b: (b.remaining / b.limit, b.policy))
    return {
        "RateLimit-Policy": f'"{tight.policy}";q={tight.limit};w={tight.window_seconds}',
        "RateLimit": f'"{tight.policy}";r={tight.remaining};t={tight.reset_after_seconds}',
    }


def create_app(
    store: BudgetStore,
    publisher: UsagePublisher,
    prices: PriceCatalog | None = None,
    lifespan: Any = None,
) -> FastAPI:
    """Build the API around an opened store and publisher (see ``admission.server``)."""
    app = FastAPI(title="spendgate admission", version="1", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if p not in ("body", "query")]
        field = ".".join(loc) or None
        return _error(400, "invalid_request", f"{field or 'body'}: {first['msg']}", field)

    @app.exception_handler(AdmissionError)
    async def _admission_error(_: Request, exc: AdmissionError) -> JSONResponse:
        return _error(exc.status, exc.code, exc.message, exc.field)

    @app.post("/v1/admit", response_model=Decision, responses={429: {"model": Decision}})
    async def admit(body: AdmitRequest) -> Response:
        with LATENCY.time():
            return await _admit(body)

    async def _admit(body: AdmitRequest) -> Response:
        try:
            matched = targets(await store.policies(), body.subject)
            model = body.subject.model
            charges = [
                Charge(t, amount(t.policy, body.estimate, prices, model=model)) for t in matched
            ]
        except MissingGroupByField as exc:
            raise BadRequest(str(exc), f"subject.{exc.field}") from exc
        except UnitError as exc:
            raise Unprocessable(str(exc), "estimate") from exc
        result = await store.admit(body.request_id, uuid.uuid4().hex, charges)
        budgets = _statuses(charges, result)
        headers = _ratelimit_headers(budgets)
        if not result.allowed:
            violated = [
                b.policy
                for b, c in zip(budgets, charges, strict=True)
                if b.used + b.reserved + c.amount > b.limit
            ]
            retry_s = (
                None
                if result.never_fits or result.retry_after_ms is None
                else max(1, math.ceil(result.retry_after_ms / 1000))
            )
            decision = Decision(
                decision="reject",
                violated=violated,
                budgets=budgets,
                retry_after_seconds=retry_s,
                never_fits=result.never_fits,
            )
            if retry_s is not None:
                headers["Retry-After"] = str(retry_s)
            DECISIONS.labels(decision="reject").inc()
            return JSONResponse(decision.model_dump(mode="json"), 429, headers)
        if not result.replayed:
            ttl_ms = max((c.target.policy.reservation_ttl_ms for c in charges), default=900_000)
            now = _now(result.now_ms)
            await store.client.set(
                reservation_key(store.prefix, result.reservation_id),
                body.subject.model_dump_json(),
                px=ttl_ms + 3_600_000,
            )
            publisher.publish(
                ReserveEvent(
                    event_id=f"reserve-{result.reservation_id}",
                    subject=body.subject,
                    occurred_at=now,
                    reservation_id=result.reservation_id,
                    usage=body.estimate,
                    expires_at=now + timedelta(milliseconds=ttl_ms),
                )
            )
        decision = Decision(
            decision="allow",
            reservation_id=result.reservation_id,
            model=body.subject.model,
            budgets=budgets,
        )
        DECISIONS.labels(decision="allow").inc()
        return JSONResponse(decision.model_dump(mode="json", exclude_none=True), 200, headers)

    async def _settle(reservation_id: str, usage: Usage | None) -> dict[str, str]:
        """Publish the commit (with usage) or release (without) of an open reservation."""
        raw = await store.client.get(reservation_key(store.prefix, reservation_id))
        if raw is None:
            raise UnknownReservation(f"no open reservation {reservation_id!r}", "reservation_id")
        common: dict[str, Any] = {
            "subject": Subject.model_validate_json(raw),
            "occurred_at": datetime.now(UTC),
            "reservation_id": reservation_id,
        }
        publisher.publish(
            CommitEvent(event_id=f"commit-{reservation_id}", usage=usage, **common)
            if usage is not None
            else ReleaseEvent(event_id=f"release-{reservation_id}", **common)
        )
        return {"status": "accepted"}

    @app.post("/v1/commit", status_code=202)
    async def commit(body: CommitRequest) -> dict[str, str]:
        return await _settle(body.reservation_id, body.usage)

    @app.post("/v1/release", status_code=202)
    async def release(body: ReleaseRequest) -> dict[str, str]:
        return await _settle(body.reservation_id, None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        try:
            ok = await store.ping()
        except Exception:  # noqa: BLE001 - any failure means not ready
            ok = False
        if ok:
            return JSONResponse({"status": "ready"})
        return _error(503, "store_unavailable", "Redis does not answer")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
