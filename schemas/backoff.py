"""What counts as a store (Redis) fault, and the bounded backoff between retries (pure)."""

from __future__ import annotations

from redis.exceptions import RedisClusterException, RedisError

__all__ = ["STORE_ERRORS", "Backoff"]

#: A Redis call that failed: refused, timed out, a cluster without a slot's master (a
#: failover), a script error. Each is a retry in the services' background work, never a
#: crash (``asyncio.TimeoutError`` is ``TimeoutError``: a bounded trip that ran out).
STORE_ERRORS: tuple[type[Exception], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    TimeoutError,
)


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
