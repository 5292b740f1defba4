"""Which errors of a call are a lost connection (``admission.replicated.connection_lost``)."""

from __future__ import annotations

import pytest

from spendgate.admission.replicated import connection_lost


def _raised(exc: Exception) -> Exception:
    with pytest.raises(type(exc)) as caught:
        raise exc
    return caught.value


@pytest.mark.parametrize("exc", [AttributeError("x"), TypeError("y"), ConnectionError("z")])
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
