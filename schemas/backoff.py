"""What counts as a store (Redis) fault, and the bounded backoff between retries (pure)."""

from __future__ import annotations

import os

from redis.exceptions import RedisClusterException, RedisError

__all__ = ["STORE_ERRORS", "Backoff", "connection_lost", "store_fault"]

#: A Redis call that failed: refused, timed out, a cluster without a slot's master (a
#: failover), a script error. Each is a retry in the services' background work, never a
#: crash (``asyncio.TimeoutError`` is ``TimeoutError``: a bounded trip that ran out).
STORE_ERRORS: tuple[type[Exception], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    TimeoutError,
)


_REDIS_CONNECTION = os.path.join("redis", "asyncio", "connection.py")


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py's asyncio connection writing to a transport the peer
    closed, so a lost connection (a node killed, a failover), not a bug of the caller:
    an ``AttributeError`` or ``TypeError`` from its write path instead of
    ``ConnectionError`` (redis-py issue 4287), or uvloop's ``RuntimeError`` ("unable to
    perform operation on <TCPTransport closed=True>") raised under it."""
    if not isinstance(exc, AttributeError | TypeError | RuntimeError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_REDIS_CONNECTION):
            return True
        tb = tb.tb_next
    return False


def store_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a store fault: one of :data:`STORE_ERRORS` or a lost connection
    (:func:`connection_lost`). Anything else is a bug and is not retried as one."""
    return isinstance(exc, STORE_ERRORS) or connection_lost(exc)


class Backoff:
    """Delays between retries: ``first_s``, doubling each failure, at most ``max_s``;
    back to ``first_s`` after a success.

    Args:
        first_s: the delay after the first failure.
        max_s: the longest delay.
    """

    def __init__(self, first_s: float = 0.1, max_s: float = 5.0) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff: need 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        #: Failures since the last success.
        self.failures = 0

    def failed(self) -> float:
        """One more failure: the delay before the next try."""
        self.failures += 1
        return min(self.max_s, self.first_s * 2.0 ** min(self.failures - 1, 32))

    def succeeded(self) -> int:
        """A success: the delays start over. Returns the failures it ended."""
        failures, self.failures = self.failures, 0
        return failures
