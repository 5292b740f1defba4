"""The dashboard's endpoints: plain functions over the :class:`Dashboard` in ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from spendgate.admission.auth import ANYONE, Authorizer, Principal
from spendgate.admission.exceptions import Unauthorized
from spendgate.admission.wire import error_content
from spendgate.dashboard.feeds import Scraper, TopicFeed
from spendgate.dashboard.reader import MAX_PAGE, BudgetReader, Sort
from spendgate.dashboard.sessions import Sessions
from spendgate.schemas.alerts import Alert
from spendgate.schemas.matching import budget_key, parse_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.refusals import Refusal
from spendgate.schemas.shards import tenant_of

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
#: The query parameters of ``GET /api/budgets``.
PAGE_PARAMS = frozenset({"tenant", "policy", "sort", "order", "offset", "limit"})


@dataclass
class Dashboard:
    """What the endpoints read, kept in ``app.state.dashboard`` (started by the caller)."""

    reader: BudgetReader
    authorizer: Authorizer
    alerts: TopicFeed[Alert]
    refusals: TopicFeed[Refusal]
    scraper: Scraper
    sessions: Sessions
    session_ttl_s: float
    secure_cookie: bool

    async def who(self, request: Request) -> Principal | None:
        """Who signed in on ``request``'s session (everyone when auth is off)."""
        if not self.authorizer.enabled:
            return ANYONE
        return await self.sessions.get(request.cookies.get(COOKIE))


def _dashboard(request: Request) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


def _error(status: int, code: str, message: str, field_name: str | None = None) -> JSONResponse:
    return JSONResponse(error_content(code, message, field_name), status, headers=HEADERS)


def _json(body: Any) -> JSONResponse:
    return JSONResponse(body, headers=HEADERS)


def _denied() -> JSONResponse:
    return _error(401, "unauthorized", "sign in with a token first")


def _me(principal: Principal, auth: bool) -> dict[str, Any]:
    tenants = None if principal.tenants is None else sorted(principal.tenants)
    operator = principal.operator or principal.tenants is None
    return {"signed_in": True, "auth": auth, "operator": operator, "tenants": tenants}


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


async def index(_: Request) -> Response:
    """``GET /``: the page."""
    return FileResponse(STATIC / "index.html", headers=HEADERS)


async def healthz(_: Request) -> Response:
    """``GET /healthz``."""
    return _json({"status": "ok"})


async def sign_in(request: Request) -> Response:
    """``POST /api/session`` ``{token}``: a session cookie for a known token."""
    dash = _dashboard(request)
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "invalid_request", "the body must be JSON {token}", "token")
    token = body.get("token") if isinstance(body, dict) else None
    if not isinstance(token, str) or not token.strip():
        return _error(400, "invalid_request", "token: a non-empty string is required", "token")
    if not dash.authorizer.enabled:
        return _json({"signed_in": True, "auth": False})
    try:
        principal = dash.authorizer.principal(f"Bearer {token.strip()}")
    except Unauthorized:
        return _error(401, "unauthorized", "unknown token", "token")
    answer = _json(_me(principal, True))
    answer.set_cookie(
        COOKIE,
        dash.sessions.open(token.strip()),
        max_age=int(dash.session_ttl_s),
        httponly=True,
        samesite="strict",
        secure=dash.secure_cookie,
        path="/",
    )
    return answer


async def sign_out(request: Request) -> Response:
    """``DELETE /api/session``: end the session, on every replica (``dashboard.sessions``)."""
    dash = _dashboard(request)
    if dash.authorizer.enabled:
        await dash.sessions.close(request.cookies.get(COOKIE))
    answer = _json({"signed_in": False})
    answer.delete_cookie(COOKIE, path="/")
    return answer


async def me(request: Request) -> Response:
    """``GET /api/me``: who is signed in and which tenants they read."""
    dash = _dashboard(request)
    principal = await dash.who(request)
    if principal is None:
        return _json({"signed_in": False, "auth": True})
    return _json(_me(principal, dash.authorizer.enabled))


@dataclass(frozen=True)
class PageQuery:
    """The query of ``GET /api/budgets``, validated."""

    tenant: str | None
    policy: str | None
    sort: Sort
    descending: bool
    offset: int
    limit: int


def _page_query(request: Request) -> PageQuery | JSONResponse:
    """The validated query of ``GET /api/budgets`` (or the 400 that says what is wrong)."""
    q = request.query_params
    unknown = set(q) - PAGE_PARAMS
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
            return _error(400, "invalid_request", f"{name}: an integer (limit 1..{MAX_PAGE})", name)
        numbers[name] = int(raw)
    return PageQuery(
        tenant=q.get("tenant") or None,
        policy=q.get("policy") or None,
        sort=sort,
        descending=order == "desc",
        offset=numbers["offset"],
        limit=numbers["limit"],
    )


async def budgets(request: Request) -> Response:
    """``GET /api/budgets``: a page of the budget keys this session may read."""
    dash = _dashboard(request)
    principal = await dash.who(request)
    if principal is None:
        return _denied()
    query = _page_query(request)
    if isinstance(query, JSONResponse):
        return query
    tenant = query.tenant
    if tenant is not None and not principal.may_read(tenant):
        return _error(403, "forbidden", f"this token may not read tenant {tenant!r}", "tenant")
    page = await dash.reader.page(
        principal.may_read,
        tenant=tenant,
        policy=query.policy,
        sort=query.sort,
        descending=query.descending,
        offset=query.offset,
        limit=query.limit,
    )
    policies = await dash.reader.policies()
    return _json(
        {
            "rows": [r.as_json() for r in page.rows],
            "matched": page.matched,
            "offset": page.offset,
            "policies": sorted(policies),
        }
    )


async def key_detail(request: Request) -> Response:
    """``GET /api/key?key=``: one key's window over time, its alerts and refusals."""
    dash = _dashboard(request)
    principal = await dash.who(request)
    if principal is None:
        return _denied()
    key = request.query_params.get("key", "")
    if not key:
        return _error(400, "invalid_request", "key: required", "key")
    policies = await dash.reader.policies()
    known, owner = dash.reader.owner(key, policies)
    if known and not principal.may_read(owner):
        return _error(403, "forbidden", "this token may not read this budget key", "key")
    found = await dash.reader.detail(key) if known else None
    if found is None:
        return _error(404, "not_found", f"no budget window for key {key!r}", "key")
    row, series = found
    marks_alerts = [
        {"at": a.at.isoformat(), "kind": a.kind, "used": a.used, "threshold": a.threshold}
        for a in dash.alerts.items
        if a.key == key
    ]
    marks_refusals = [
        r.at.isoformat() for r in dash.refusals.items if key in refusal_keys(r, policies)
    ]
    return _json(
        {"row": row.as_json(), "series": series, "alerts": marks_alerts, "refusals": marks_refusals}
    )


async def live(request: Request) -> Response:
    """``GET /api/live``: the latest alerts and refusals this session may read, and (for a
    token that reads every tenant) admission's and the worker's metrics."""
    dash = _dashboard(request)
    principal = await dash.who(request)
    if principal is None:
        return _denied()
    policies = await dash.reader.policies()
    shown_alerts = [
        {**a.model_dump(mode="json"), "tenant": alert_tenant(a, policies)}
        for a in reversed(dash.alerts.items)
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
        for r in reversed(dash.refusals.items)
        if principal.may_read(r.subject.tenant)
    ][:SHOWN]
    now = datetime.now(UTC)
    recent = sum(1 for r in dash.refusals.items if now - r.at <= timedelta(seconds=60))
    # Admission's counters span every tenant: only a token that reads them all sees them.
    sees_all = principal.may_read(None)
    return _json(
        {
            "metrics": dash.scraper.panel() if sees_all else None,
            "refusals_last_60s": recent,
            "alerts": shown_alerts,
            "refusals": shown_refusals,
            "now_ms": await dash.reader.now_ms(),
        }
    )


async def store_down(_: Request, exc: Exception) -> Response:
    """Any endpoint whose Redis read failed: 503 ``store_unavailable``."""
    return _error(503, "store_unavailable", f"Redis does not answer: {exc}")
