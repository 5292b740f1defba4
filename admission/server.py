"""Open the admission service's resources in one place and serve the API with uvicorn."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from admission.app import create_app
from admission.auth import Authorizer, load_tokens
from admission.backpressure import Backpressure
from admission.publisher import KafkaPublisher
from admission.redis_check import warn_if_not_durable
from admission.settings import AdmissionSettings
from admission.store import BudgetStore
from admission.sweeper import ReserveSweeper
from schemas.prices import load_catalog

logger = logging.getLogger(__name__)


def redis_client(settings: AdmissionSettings) -> aioredis.Redis:
    """A Redis client that gives up fast: short timeouts and no hidden retries.

    The failure modes decide what happens when Redis is gone; redis-py's default retries
    would only multiply the time a caller waits for that answer.
    """
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_connections,
        # The store's backpressure queues calls before they ask the pool, so this wait is
        # only a backstop (answered as overload, never as a failing Redis).
        timeout=settings.redis_queue_wait_s,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    return aioredis.Redis(connection_pool=pool)


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
    )


def build_app(settings: AdmissionSettings) -> FastAPI:
    """The admission app whose lifespan opens Redis and the Kafka producer."""
    client = redis_client(settings)
    store = budget_store(settings, client)
    publisher = KafkaPublisher(
        settings.kafka_bootstrap,
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
    )
    publisher.on_acked = sweeper.acked
    authorizer = Authorizer(
        load_tokens(settings.auth_tokens_file) if settings.auth_tokens_file else None
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not authorizer.enabled:
            logger.warning(
                "AUTH IS OFF: any caller may act for any tenant (set SPENDGATE_AUTH_TOKENS_FILE)"
            )
        await warn_if_not_durable(client)
        try:
            # The sweeper stops first (nothing republished into a closing publisher); the
            # reserves acked while the publisher drains are unlisted after it.
            async with publisher, sweeper:
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
    )


def serve(settings: AdmissionSettings) -> None:
    """Serve until interrupted."""
    uvicorn.run(
        build_app(settings),
        host=settings.admission_host,
        port=settings.admission_port,
        log_level="warning",
        access_log=False,
    )
