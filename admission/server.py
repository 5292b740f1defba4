"""Open the admission service's resources in one place and serve the API with uvicorn."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI

from admission.app import create_app
from admission.publisher import KafkaPublisher
from admission.settings import AdmissionSettings
from admission.store import BudgetStore
from schemas.prices import load_catalog

logger = logging.getLogger(__name__)


def build_app(settings: AdmissionSettings) -> FastAPI:
    """The admission app whose lifespan opens Redis and the Kafka producer."""
    client = aioredis.Redis.from_url(settings.redis_url)
    store = BudgetStore(client, settings.redis_prefix, settings.policy_refresh_s)
    publisher = KafkaPublisher(
        settings.kafka_bootstrap, settings.topic("usage"), settings.publish_buffer
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.auth_tokens_file is None:
            logger.warning(
                "AUTH IS OFF: any caller may act for any tenant (set SPENDGATE_AUTH_TOKENS_FILE)"
            )
        async with publisher:
            try:
                yield
            finally:
                await client.aclose()

    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    return create_app(store, publisher, prices, lifespan=lifespan)


def serve(settings: AdmissionSettings) -> None:
    """Serve until interrupted."""
    uvicorn.run(
        build_app(settings),
        host=settings.admission_host,
        port=settings.admission_port,
        log_level="warning",
        access_log=False,
    )
