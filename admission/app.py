"""The admission HTTP app: its state, its endpoints and its error answers, wired together.

The endpoints are plain functions in :mod:`admission.routes` reading
:class:`admission.state.AdmissionState` from ``app.state.admission``; errors are answered
by :mod:`admission.handlers`. ``POST /v1/admit`` is served by
:class:`admission.admit.AdmitEndpoint` in front of the app (one parse, one plan, one
script round trip, one answer); the route declared for it answers the bodies that path
hands on, through the same ``AdmitService.admit``. What a decision is lives in
:mod:`admission.decide`, Redis behind :mod:`admission.store`. A saturated process (its
queue of Redis calls full, or a call held up by the event loop) answers 503
``overloaded``; see :mod:`admission.backpressure`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from spendgate.admission.admit import DEFAULT_DELAY_WAITERS, AdmitEndpoint, AdmitService
from spendgate.admission.auth import Authorizer
from spendgate.admission.decide import Planner, build_plans, cap_terms, ratelimit_headers
from spendgate.admission.delay import Delays
from spendgate.admission.extend import ExtendService
from spendgate.admission.fallback import DegradedLedger
from spendgate.admission.handlers import install_handlers
from spendgate.admission.publisher import UsagePublisher
from spendgate.admission.refusals import RefusalSink
from spendgate.admission.routes import api, probes
from spendgate.admission.settle import Settler
from spendgate.admission.state import AdmissionState
from spendgate.admission.store import BudgetStore
from spendgate.admission.wire import BodyGuard
from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.prices import PriceCatalog

#: Largest request body accepted (admit bodies are a few hundred bytes).
DEFAULT_MAX_BODY_BYTES = 64 * 1024


class AdmissionAPI(FastAPI):
    """The FastAPI app with ``POST /v1/admit`` served in front of it.

    The fast path (:class:`admission.admit.AdmitEndpoint`) comes before FastAPI's own
    ``__call__``: an admit it serves skips the framework's per-request work (its
    OpenTelemetry check reads the environment on every request; nothing in spendgate
    configures OpenTelemetry), and everything else goes on to :meth:`framework`. So an
    operator who turns on FastAPI's own telemetry sees every request but the admits the
    fast path served (those handed on to the route are seen); spendgate's Prometheus
    metrics count every admit.
    """

    front: ASGIApp

    async def framework(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's handling of a request (every request but the fast path's admits)."""
        await super().__call__(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)


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
    key_ids: KeyIds | None = None,
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
        key_ids: the secret subject fields' key ids (``schemas.key_ids``); requests and
            budget queries are decided on them. None: subject values are kept as sent.
    """
    local = ledger or DegradedLedger()
    admits = AdmitService(
        store, publisher, prices, local, refusals, Delays(delay_waiters), key_ids=key_ids
    )
    app = AdmissionAPI(
        title="spendgate admission",
        version="1",
        lifespan=lifespan,
        description=(
            "Rolling-window spend budgets: one atomic check-and-reserve over every "
            "matching policy. Errors are `{error: {code, message, field?}}`."
        ),
    )
    app.state.admission = AdmissionState(
        store=store,
        publisher=publisher,
        authorizer=authorizer or Authorizer(None),
        admits=admits,
        extender=ExtendService(store, publisher, admits.planner),
        settler=Settler(store, publisher, local),
        max_body_bytes=max_body_bytes,
    )
    app.front = AdmitEndpoint(app.framework, admits, app.state.admission.authorizer, max_body_bytes)
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes)
    install_handlers(app)
    app.include_router(api)
    app.include_router(probes)
    return app


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "AdmissionAPI",
    "BodyGuard",
    "Planner",
    "build_plans",
    "cap_terms",
    "create_app",
    "ratelimit_headers",
]
