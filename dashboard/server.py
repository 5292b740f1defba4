"""Run the dashboard: its Redis client, Kafka feeds and metric scraper around the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.applications import Starlette

from spendgate.admission.auth import Authorizer, check_exposure, is_loopback, load_tokens
from spendgate.dashboard.app import create_app
from spendgate.dashboard.feeds import Scraper, TopicFeed
from spendgate.dashboard.reader import BudgetReader
from spendgate.dashboard.settings import DashboardSettings
from spendgate.schemas import kafka_connect
from spendgate.schemas.alerts import Alert
from spendgate.schemas.connections import check_connections
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.redis_connect import async_client, check, layout_of
from spendgate.schemas.refusals import Refusal

logger = logging.getLogger(__name__)


def build_app(settings: DashboardSettings) -> Starlette:
    """The dashboard app whose lifespan runs the alert and refusal feeds and the scraper."""
    redis = settings.redis()
    client = async_client(redis)
    reader = BudgetReader(
        client, settings.redis_prefix, layout_of(settings.redis_prefix, settings.redis_cluster)
    )
    kafka = settings.kafka()
    alerts = TopicFeed(kafka, settings.topic("alerts"), Alert, settings.feed_size)
    # A client retrying after a 429 publishes the same refusal again: count it once.
    refusals = TopicFeed(
        kafka,
        settings.topic("refusals"),
        Refusal,
        settings.feed_size,
        identity=lambda r: f"{r.subject.tenant}|{r.request_id}",
    )
    scraper = Scraper(
        settings.admission_metrics_url, settings.worker_metrics_url, settings.scrape_s
    )
    authorizer = Authorizer(
        load_tokens(settings.auth_tokens_file) if settings.auth_tokens_file else None
    )
    session_secret = _session_secret(settings, authorizer.enabled)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if not authorizer.enabled:
            logger.warning(
                "DASHBOARD AUTH IS OFF: whoever reaches it sees every tenant "
                "(set SPENDGATE_AUTH_TOKENS_FILE)"
            )
        tasks = [asyncio.create_task(t.run()) for t in (alerts, refusals, scraper)]
        try:
            # Wrong credentials or certificates: one line naming the setting, no page.
            await check(client, redis)
            await kafka_connect.check(kafka, timeout_s=5.0)
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await client.aclose()

    return create_app(
        reader,
        authorizer,
        alerts,
        refusals,
        scraper,
        session_ttl_s=settings.session_ttl_s,
        session_secret=session_secret,
        secure_cookie=settings.secure_cookie,
        lifespan=lifespan,
    )


def _session_secret(settings: DashboardSettings, auth: bool) -> bytes | None:
    """The secret that signs the session cookies: where sessions exist (auth on) and the
    page is reachable beyond loopback (a deployment, maybe of several replicas), one must
    be set; on loopback (a developer's machine) a random one does, with a warning.

    Raises:
        ConfigurationError: none set where it is needed, or a bad one (one line).
    """
    secret = settings.session_secret()
    if secret is not None or not auth:
        return secret
    if not is_loopback(settings.dashboard_host):
        raise ConfigurationError(
            f"spendgate dashboard: listening on {settings.dashboard_host} with auth needs "
            "SPENDGATE_DASHBOARD_SESSION_SECRET_FILE (or SPENDGATE_DASHBOARD_SESSION_SECRET), "
            "shared by every replica, so that sessions survive restarts and work on each "
            "(generate one: python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    logger.warning(
        "no SPENDGATE_DASHBOARD_SESSION_SECRET_FILE: sessions are signed with a random secret "
        "and end when this dashboard stops"
    )
    return None


def serve(settings: DashboardSettings) -> None:
    """Serve the dashboard until interrupted."""
    # httpx logs each request at INFO: two scrapes a second would drown the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    check_exposure(
        "dashboard",
        settings.dashboard_host,
        settings.dashboard_port,
        settings.auth_tokens_file,
        settings.allow_unauthenticated,
    )
    # The operator's files first (refused before anything is reached), then wrong
    # credentials stop here with one line (the app's start checks again).
    app = build_app(settings)
    asyncio.run(check_connections(settings.kafka(), settings.redis()))
    logger.info("dashboard on http://%s:%d/", settings.dashboard_host, settings.dashboard_port)
    uvicorn.run(
        app,
        host=settings.dashboard_host,
        port=settings.dashboard_port,
        log_level="warning",
        access_log=False,
    )
