"""A synchronous readiness probe: does the broker answer a metadata request?"""

from __future__ import annotations

import asyncio


async def _metadata(bootstrap: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        await admin.start()
        await admin.describe_cluster()
        return True
    except Exception:  # noqa: BLE001 - any failure means "not ready yet"
        return False
    finally:
        await admin.close()


def metadata_ok(bootstrap: str) -> bool:
    """True when the broker at ``bootstrap`` answers a cluster metadata request."""
    return asyncio.run(_metadata(bootstrap))
