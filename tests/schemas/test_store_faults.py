"""Which errors of a Redis call are store faults (``schemas.backoff``): retried by the
services' background work and answered by the failure modes, never a crash."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from spendgate.schemas.backoff import connection_lost, store_fault


def _raised(exc: Exception) -> Exception:
    with pytest.raises(type(exc)) as caught:
        raise exc
    return caught.value


@pytest.mark.parametrize(
    "exc", [AttributeError("x"), TypeError("y"), RuntimeError("r"), ConnectionError("z")]
)
def test_an_error_raised_outside_the_redis_connection_is_not_a_lost_connection(
    exc: Exception,
) -> None:
    assert not connection_lost(_raised(exc))


async def test_a_write_on_a_closed_transport_inside_redis_py_is_a_lost_connection() -> None:
    from redis.asyncio.connection import Connection

    conn = Connection()
    # Its writer gone, as after the peer closed the transport under it.
    with pytest.raises(AttributeError) as caught:
        await conn._send_packed_command([b"PING"])
    assert connection_lost(caught.value)
    assert store_fault(caught.value)


class _ClosedUvloopTransport:
    """What uvloop's stream writer does once its transport closed under it."""

    def writelines(self, data: object) -> None:
        raise RuntimeError(
            "unable to perform operation on <TCPTransport closed=True reading=False>; "
            "the handler is closed"
        )


async def test_uvloop_s_closed_transport_inside_redis_py_is_a_lost_connection() -> None:
    from redis.asyncio.connection import Connection

    conn = Connection()
    conn._writer = _ClosedUvloopTransport()  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError) as caught:
            await conn._send_packed_command([b"PING"])
    finally:
        conn._writer = None  # nothing to close when it is collected
    assert connection_lost(caught.value)
    assert store_fault(caught.value)


def test_redis_errors_are_store_faults_and_bugs_are_not() -> None:
    assert store_fault(_raised(RedisConnectionError("refused")))
    assert store_fault(_raised(TimeoutError()))
    assert not store_fault(_raised(AttributeError("a bug of ours")))
    assert not store_fault(_raised(RuntimeError("a bug of ours")))
