"""Open the admission service's resources in one place and serve the API with uvicorn."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from spendgate.admission.app import create_app
from spendgate.admission.auth import Authorizer, check_exposure, load_tokens
from spendgate.admission.backpressure import Backpressure
from spendgate.admission.publisher import KafkaPublisher
from spendgate.admission.redis_check import warn_if_not_durable
from spendgate.admission.refusals import KafkaRefusals
from spendgate.admission.settings import AdmissionSettings
from spendgate.admission.store import BudgetStore
from spendgate.admission.sweeper import ReserveSweeper
from spendgate.schemas import kafka_connect, redis_connect
from spendgate.schemas.connections import check_connections
from spendgate.schemas.key_settings import announce
from spendgate.schemas.prices import load_catalog
from spendgate.schemas.redis_connect import layout_of

logger = logging.getLogger(__name__)


def redis_client(settings: AdmissionSettings) -> aioredis.Redis:
    """A Redis client that gives up fast: short timeouts and no hidden retries.

    The failure modes decide what happens when Redis is gone; redis-py's default retries
    would only multiply the time a caller waits for that answer. On a cluster, one pool
    per node, each capped; the store's backpressure bounds the calls.
    """
    return redis_connect.async_client(
        settings.redis(),
        # The store's backpressure queues calls before they ask the pool, so this wait is
        # only a backstop (answered as overload, never as a failing Redis).
        pool_timeout_s=settings.redis_queue_wait_s,
        max_connections=settings.redis_connections,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def budget_store(settings: AdmissionSettings, client: aioredis.Redis) -> BudgetStore:
    """The store on ``client`` (from :func:`redis_client`), its queue sized to the pool."""
    backpressure = Backpressure(
        slots=settings.redis_connections,
        queue=settings.redis_queue,
        wait_s=settings.redis_queue_wait_s,
        timeout_s=settings.redis_timeout_s,
    )
    return BudgetStore(
        client,
        settings.redis_prefix,
        settings.policy_refresh_s,
        settings.redis_down_s,
        backpressure=backpressure,
        staleness_ms=int(settings.staleness_s * 1000),
        layout=layout_of(settings.redis_prefix, settings.redis_cluster),
        piece_grace_ms=int(settings.reserve_grace_s * 1000),
        wait_replicas=settings.redis_wait_replicas,
        wait_ms=settings.redis_wait_ms,
    )


def build_app(settings: AdmissionSettings) -> FastAPI:
    """The admission app whose lifespan opens Redis and the Kafka producer."""
    kafka = settings.kafka()
    redis_conn = settings.redis()
    client = redis_client(settings)
    store = budget_store(settings, client)
    publisher = KafkaPublisher(
        kafka,
        settings.topic("usage"),
        settings.publish_buffer,
        ack_timeout_s=settings.ack_timeout_s,
        shutdown_s=settings.shutdown_publish_s,
    )
    sweeper = ReserveSweeper(
        client,
        settings.redis_prefix,
        publisher,
        grace_s=settings.reserve_grace_s,
        interval_s=settings.reserve_sweep_s,
        layout=store.layout,
        wait_replicas=store.wait_replicas,
        wait_ms=store.wait_ms,
    )
    publisher.on_acked = sweeper.acked
    refusals = KafkaRefusals(kafka, settings.topic("refusals"), settings.refusal_buffer)
    authorizer = Authorizer(
        load_tokens(settings.auth_tokens_file) if settings.auth_tokens_file else None
    )
    key_ids = settings.key_ids()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not authorizer.enabled:
            logger.warning(
                "AUTH IS OFF: any caller may act for any tenant (set SPENDGATE_AUTH_TOKENS_FILE)"
            )
        announce(key_ids, logger)
        try:
            # Wrong credentials or certificates stop the start with one line naming the
            # setting; an unreachable Redis does not (the failure modes answer for it).
            await redis_connect.check(client, redis_conn)
            await kafka_connect.check(kafka, timeout_s=5.0)
            await warn_if_not_durable(client)
            # The sweeper stops first (nothing republished into a closing publisher); the
            # reserves acked while the publisher drains are unlisted after it.
            async with refusals, publisher, sweeper:
                yield
            await sweeper.unlist_remaining()
        finally:
            await client.aclose()

    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    return create_app(
        store,
        publisher,
        prices,
        lifespan=lifespan,
        authorizer=authorizer,
        max_body_bytes=settings.max_body_bytes,
        refusals=refusals,
        delay_waiters=settings.delay_waiters,
        key_ids=key_ids,
    )


def app_from_env() -> FastAPI:
    """The app of one worker process of ``serve(..., workers=N)``: its settings are read
    from the environment when the process starts (as ``spendgate admission`` reads them)."""
    return build_app(AdmissionSettings())


def uvicorn_options() -> dict[str, Any]:
    """The server stack, chosen by measurement (``bench/admission.py``): uvloop's event
    loop and httptools' HTTP parser, each when installed (else asyncio's loop, h11)."""
    return {
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
        "log_level": "warning",
        "access_log": False,
    }


def serve(settings: AdmissionSettings, workers: int = 1) -> None:
    """Serve until interrupted, in ``workers`` processes sharing the listening port.

    Every process decides through the same atomic script, so they need nothing from each
    other. With more than one, each process builds its app with :func:`app_from_env`, so
    ``settings`` must be the environment's (as the CLI's are).
    """
    options = uvicorn_options()
    host, port = settings.admission_host, settings.admission_port
    check_exposure(
        "admission", host, port, settings.auth_tokens_file, settings.allow_unauthenticated
    )
    # The operator's files first (tokens, secrets, prices: refused before anything is
    # reached), then wrong credentials stop here with one line; the app's start checks
    # again (it may be built without this function). Building the app connects nothing.
    app = build_app(settings)
    asyncio.run(check_connections(settings.kafka(), settings.redis()))
    if workers > 1:
        uvicorn.run(
            "spendgate.admission.server:app_from_env",
            factory=True,
            workers=workers,
            host=host,
            port=port,
            **options,
        )
    else:
        uvicorn.run(app, host=host, port=port, **options)
