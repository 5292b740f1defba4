"""The start check of every service: wrong credentials or certificates for Kafka or Redis
stop it with one line naming the setting, before it serves anything."""

from __future__ import annotations

from spendgate.schemas import kafka_connect, redis_connect
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.redis_connect import RedisConnection

__all__ = ["check_connections"]


async def check_connections(
    kafka: KafkaConnection, redis: RedisConnection, timeout_s: float = 5.0
) -> None:
    """One connection to each (``kafka_connect.check``, ``redis_connect.check``). A service
    merely unreachable passes: what follows waits, retries or answers by the failure modes.

    Raises:
        ConfigurationError: naming the setting to fix.
    """
    await kafka_connect.check(kafka, timeout_s=timeout_s)
    client = redis_connect.async_client(redis)
    try:
        await redis_connect.check(client, redis)
    finally:
        await client.aclose()
