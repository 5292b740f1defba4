"""The dashboard's ASGI app: one page, its static assets and the read-only JSON it polls."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from spendgate.admission.auth import ANYONE, Authorizer, Principal
from spendgate.admission.exceptions import Unauthorized
from spendgate.admission.wire import error_content
from spendgate.dashboard.feeds import Scraper, TopicFeed
from spendgate.dashboard.reader import MAX_PAGE, BudgetReader, Sort
from spendgate.dashboard.views import tenant_of
from spendgate.schemas.alerts import Alert
from spendgate.schemas.matching import budget_key, parse_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.refusals import Refusal

STATIC = Path(__file__).parent / "static"
COOKIE = "spendgate_session"
SORTS: tuple[Sort, ...] = ("share", "key", "policy", "tenant")
#: Latest alerts and refusals the page lists.
SHOWN = 50
#: What the page may load: only this origin (no CDN, no inline script).
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass
class Sessions:
    """Browser sessions: a random id (the HTTP-only cookie) -> who signed in, until when."""

    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    _live: dict[str, tuple[Principal, float]] = field(default_factory=dict)

    def open(self, who: Principal) -> str:
        """A new session for ``who``; returns its id."""
        now = self.clock()
        self._live = {k: v for k, v in self._live.items() if v[1] > now}
        sid = secrets.token_urlsafe(32)
        self._live[sid] = (who, now + self.ttl_s)
        return sid

    def get(self, sid: str | None) -> Principal | None:
        """Who holds session ``sid`` (``None``: no such session, or it ended)."""
        found = self._live.get(sid or "")
        if found is None or found[1] <= self.clock():
            return None
        return found[0]

    def close(self, sid: str | None) -> None:
        """End session ``sid``."""
        self._live.pop(sid or "", None)


def _error(status: int, code: str, message: str, field_name: str | None = None) -> JSONResponse:
    return JSONResponse(error_content(code, message, field_name), status, headers=HEADERS)


def _json(body: Any) -> JSONResponse:
    return JSONResponse(body, headers=HEADERS)


def alert_tenant(alert: Alert, policies: dict[str, Policy]) -> str | None:
    """The tenant an alert's budget key belongs to (``views.tenant_of``)."""
    pid, fields = parse_key(alert.key)
    p = policies.get(pid)
    return tenant_of(p, fields) if p is not None else fields.get("tenant")


def refusal_keys(refusal: Refusal, policies: dict[str, Policy]) -> list[str]:
    """The budget keys a refusal was refused on (its violated policies in force)."""
    keys = []
    for pid in refusal.violated:
        p = policies.get(pid)
        if p is not None:
            try:
                keys.append(budget_key(p, refusal.subject))
            except ValueError:
                continue
    return keys


def create_app(
    reader: BudgetReader,
    authorizer: Authorizer,
    alerts: TopicFeed[Alert],
    refusals: TopicFeed[Refusal],
    scraper: Scraper,
    *,
    session_ttl_s: float = 8 * 3600.0,
    secure_cookie: bool = False,
    lifespan: Any = None,
) -> Starlette:
    """The dashboard app over its reader, feeds and scraper (started by the caller)."""
    sessions = Sessions(session_ttl_s)

    def who(request: Request) -> Principal | None:
        if not authorizer.enabled:
            return ANYONE
        return sessions.get(request.cookies.get(COOKIE))

    def denied() -> JSONResponse:
        return _error(401, "unauthorized", "sign in with a token first")

    async def index(_: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=HEADERS)

    async def sign_in(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "invalid_request", "the body must be JSON {token}", "token")
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token.strip():
            return _error(400, "invalid_request", "token: a non-empty string is required", "token")
        if not authorizer.enabled:
            return _json({"signed_in": True, "auth": False})
        try:
            principal = authorizer.principal(f"Bearer {token.strip()}")
        except Unauthorized:
            return _error(401, "unauthorized", "unknown token", "token")
        answer = _json(_me(principal, True))
        answer.set_cookie(
            COOKIE,
            sessions.open(principal),
            max_age=int(session_ttl_s),
            httponly=True,
            samesite="strict",
            secure=secure_cookie,
            path="/",
        )
        return answer

    async def sign_out(request: Request) -> Response:
        sessions.close(request.cookies.get(COOKIE))
        answer = _json({"signed_in": False})
        answer.delete_cookie(COOKIE, path="/")
        return answer

    def _me(principal: Principal, auth: bool) -> dict[str, Any]:
        tenants = None if principal.tenants is None else sorted(principal.tenants)
        operator = principal.operator or principal.tenants is None
        return {"signed_in": True, "auth": auth, "operator": operator, "tenants": tenants}

    async def me(request: Request) -> Response:
        principal = who(request)
        if principal is None:
            return _json({"signed_in": False, "auth": True})
        return _json(_me(principal, authorizer.enabled))

    async def budgets(request: Request) -> Response:
        principal = who(request)
        if principal is None:
            return denied()
        q = request.query_params
        unknown = set(q) - {"tenant", "policy", "sort", "order", "offset", "limit"}
        if unknown:
            name = sorted(unknown)[0]
            return _error(400, "invalid_request", f"unknown query parameter {name!r}", name)
        sort = q.get("sort", "share")
        if sort not in SORTS:
            return _error(400, "invalid_request", f"sort: one of {', '.join(SORTS)}", "sort")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            return _error(400, "invalid_request", "order: asc or desc", "order")
        numbers: dict[str, int] = {}
        for name, default, top in (("offset", 0, 10**9), ("limit", 50, MAX_PAGE)):
            raw = q.get(name, str(default))
            if not raw.isdigit() or not (name == "offset" or 1 <= int(raw) <= top):
                return _error(
                    400, "invalid_request", f"{name}: an integer (limit 1..{MAX_PAGE})", name
                )
            numbers[name] = int(raw)
        tenant = q.get("tenant") or None
        if tenant is not None and not principal.may_read(tenant):
            return _error(403, "forbidden", f"this token may not read tenant {tenant!r}", "tenant")
        page = await reader.page(
            principal.may_read,
            tenant=tenant,
            policy=q.get("policy") or None,
            sort=sort,
            descending=order == "desc",
            offset=numbers["offset"],
            limit=numbers["limit"],
        )
        policies = await reader.policies()
        return _json(
            {
                "rows": [r.as_json() for r in page.rows],
                "matched": page.matched,
                "offset": page.offset,
                "policies": sorted(policies),
            }
        )

    async def key_detail(request: Request) -> Response:
        principal = who(request)
        if principal is None:
            return denied()
        key = request.query_params.get("key", "")
        if not key:
            return _error(400, "invalid_request", "key: required", "key")
        policies = await reader.policies()
        known, owner = reader.owner(key, policies)
        if known and not principal.may_read(owner):
            return _error(403, "forbidden", "this token may not read this budget key", "key")
        found = await reader.detail(key) if known else None
        if found is None:
            return _error(404, "not_found", f"no budget window for key {key!r}", "key")
        row, series = found
        marks_alerts = [
            {"at": a.at.isoformat(), "kind": a.kind, "used": a.used, "threshold": a.threshold}
            for a in alerts.items
            if a.key == key
        ]
        marks_refusals = [
            r.at.isoformat() for r in refusals.items if key in refusal_keys(r, policies)
        ]
        return _json(
            {
                "row": row.as_json(),
                "series": series,
                "alerts": marks_alerts,
                "refusals": marks_refusals,
            }
        )

    async def live(request: Request) -> Response:
        principal = who(request)
        if principal is None:
            return denied()
        policies = await reader.policies()
        shown_alerts = [
            {**a.model_dump(mode="json"), "tenant": alert_tenant(a, policies)}
            for a in reversed(alerts.items)
            if principal.may_read(alert_tenant(a, policies))
        ][:SHOWN]
        shown_refusals = [
            {
                "at": r.at.isoformat(),
                "request_id": r.request_id,
                "tenant": r.subject.tenant,
                "violated": list(r.violated),
                "keys": refusal_keys(r, policies),
            }
            for r in reversed(refusals.items)
            if principal.may_read(r.subject.tenant)
        ][:SHOWN]
        now = datetime.now(UTC)
        recent = sum(1 for r in refusals.items if now - r.at <= timedelta(seconds=60))
        # Admission's counters span every tenant: only a token that reads them all sees them.
        sees_all = principal.may_read(None)
        return _json(
            {
                "metrics": scraper.panel() if sees_all else None,
                "refusals_last_60s": recent,
                "alerts": shown_alerts,
                "refusals": shown_refusals,
                "now_ms": await reader.now_ms(),
            }
        )

    async def healthz(_: Request) -> Response:
        return _json({"status": "ok"})

    routes = [
        Route("/", index),
        Route("/healthz", healthz),
        Route("/api/session", sign_in, methods=["POST"]),
        Route("/api/session", sign_out, methods=["DELETE"]),
        Route("/api/me", me),
        Route("/api/budgets", budgets),
        Route("/api/key", key_detail),
        Route("/api/live", live),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    async def store_down(_: Request, exc: Exception) -> Response:
        return _error(503, "store_unavailable", f"Redis does not answer: {exc}")

    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={RedisError: store_down},
    )
