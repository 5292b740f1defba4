"""The dashboard's ASGI app: one page, its static assets and the read-only JSON it polls."""

from __future__ import annotations

import secrets
from typing import Any

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from spendgate.admission.auth import Authorizer
from spendgate.dashboard import endpoints
from spendgate.dashboard.endpoints import COOKIE as COOKIE
from spendgate.dashboard.endpoints import HEADERS as HEADERS
from spendgate.dashboard.endpoints import SHOWN as SHOWN
from spendgate.dashboard.endpoints import SORTS as SORTS
from spendgate.dashboard.endpoints import STATIC, Dashboard
from spendgate.dashboard.endpoints import alert_tenant as alert_tenant
from spendgate.dashboard.endpoints import refusal_keys as refusal_keys
from spendgate.dashboard.feeds import Scraper, TopicFeed
from spendgate.dashboard.reader import BudgetReader
from spendgate.dashboard.sessions import RedisSignOuts, Sessions
from spendgate.schemas.alerts import Alert
from spendgate.schemas.refusals import Refusal

# The ``X as X`` imports keep importable from here what this module offered before its
# endpoints moved to ``dashboard.endpoints`` and its sessions to ``dashboard.sessions``.


def _routes() -> list[Route | Mount]:
    """The page, its API and its static files."""
    return [
        Route("/", endpoints.index),
        Route("/healthz", endpoints.healthz),
        Route("/api/session", endpoints.sign_in, methods=["POST"]),
        Route("/api/session", endpoints.sign_out, methods=["DELETE"]),
        Route("/api/me", endpoints.me),
        Route("/api/budgets", endpoints.budgets),
        Route("/api/key", endpoints.key_detail),
        Route("/api/live", endpoints.live),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]


def create_app(
    reader: BudgetReader,
    authorizer: Authorizer,
    alerts: TopicFeed[Alert],
    refusals: TopicFeed[Refusal],
    scraper: Scraper,
    *,
    session_ttl_s: float = 8 * 3600.0,
    session_secret: bytes | None = None,
    secure_cookie: bool = False,
    lifespan: Any = None,
) -> Starlette:
    """The dashboard app over its reader, feeds and scraper (started by the caller).

    ``session_secret`` signs the session cookies (``dashboard.sessions``); ``None``: a random
    one, so sessions end with this process and no other replica takes them.
    """
    sessions = Sessions(
        session_secret or secrets.token_bytes(32),
        session_ttl_s,
        authorizer,
        RedisSignOuts(reader.client, reader.layout.control),
    )
    app = Starlette(
        routes=_routes(),
        lifespan=lifespan,
        exception_handlers={RedisError: endpoints.store_down},
    )
    app.state.dashboard = Dashboard(
        reader,
        authorizer,
        alerts,
        refusals,
        scraper,
        sessions,
        session_ttl_s,
        secure_cookie,
    )
    return app
