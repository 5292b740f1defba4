"""A synchronous readiness probe: does the broker answer a metadata request?"""

from __future__ import annotations

import asyncio

from spendgate.schemas import kafka_connect
from spendgate.schemas.kafka_connect import KafkaConnection


async def _metadata(kafka: KafkaConnection) -> bool:
    admin = kafka_connect.admin(kafka, request_timeout_ms=3000)
    try:
        await admin.start()
        await admin.describe_cluster()
        return True
    except Exception:  # noqa: BLE001 - any failure means "not ready yet"
        return False
    finally:
        await admin.close()


def metadata_ok(kafka: KafkaConnection) -> bool:
    """True when the brokers of ``kafka`` answer a cluster metadata request."""
    return asyncio.run(_metadata(kafka))
