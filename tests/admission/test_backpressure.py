"""Backpressure without services: the queue bounds, and what a failed call is blamed on."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from spendgate.admission.backpressure import Backpressure
from spendgate.admission.exceptions import Overloaded, StoreUnavailable
from spendgate.admission.store import BudgetStore


def _overloaded(reason: str) -> float:
    sample = REGISTRY.get_sample_value("spendgate_admission_overloaded_total", {"reason": reason})
    return sample or 0.0


class TestQueue:
    async def test_a_free_slot_is_taken_at_once(self) -> None:
        gate = Backpressure(slots=2, queue=0, wait_s=0.1, timeout_s=0.25)
        await gate.acquire()
        await gate.acquire()
        assert gate.running == 2
        gate.release()
        gate.release()
        assert gate.running == 0

    async def test_a_full_queue_refuses_at_once(self) -> None:
        gate = Backpressure(slots=1, queue=1, wait_s=5.0, timeout_s=0.25)
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert gate.waiting == 1
        before = _overloaded("queue_full")
        started = time.monotonic()
        with pytest.raises(Overloaded, match="over its queue"):
            await gate.acquire()
        assert time.monotonic() - started < 0.1
        assert _overloaded("queue_full") - before == 1
        gate.release()
        await waiter
        assert (gate.running, gate.waiting) == (1, 0)
        gate.release()

    async def test_a_call_waits_boundedly_for_a_slot(self) -> None:
        gate = Backpressure(slots=1, queue=10, wait_s=0.05, timeout_s=0.25)
        await gate.acquire()
        before = _overloaded("queue_wait")
        with pytest.raises(Overloaded, match=r"waited 0\.05s"):
            await gate.acquire()
        assert _overloaded("queue_wait") - before == 1
        assert gate.waiting == 0
        gate.release()
        # The refused waiter left no trace: the slot is free again.
        await asyncio.wait_for(gate.acquire(), 0.1)
        gate.release()

    async def test_slots_go_to_waiters_in_order(self) -> None:
        gate = Backpressure(slots=1, queue=10, wait_s=1.0, timeout_s=0.25)
        await gate.acquire()
        order: list[int] = []

        async def call(i: int) -> None:
            await gate.acquire()
            order.append(i)
            gate.release()

        tasks = [asyncio.create_task(call(i)) for i in range(5)]
        await asyncio.sleep(0)
        gate.release()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]


class TestBlame:
    def test_a_pool_wait_is_overload(self) -> None:
        gate = Backpressure(slots=1, queue=1, wait_s=1.0, timeout_s=0.25)
        try:
            try:
                raise TimeoutError
            except TimeoutError as cause:
                raise RedisConnectionError("No connection available.") from cause
        except RedisConnectionError as exc:
            assert gate.blame(exc, 0.0) == "pool_wait"

    def test_refused_and_reset_connections_are_redis(self) -> None:
        gate = Backpressure(slots=1, queue=1, wait_s=1.0, timeout_s=0.25)
        refused = RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        assert gate.blame(refused, 0.0) is None
        assert gate.blame(ConnectionResetError(), 0.0) is None


class TestLoopLag:
    async def test_the_loop_is_sampled_only_while_calls_run(self) -> None:
        gate = Backpressure(slots=1, queue=0, wait_s=1.0, timeout_s=0.05)  # ticks of 5 ms
        started = await gate.acquire()
        time.sleep(0.03)  # noqa: ASYNC251 - the loop is held up on purpose
        await asyncio.sleep(0.01)
        assert 0.02 <= gate.lag.worst_since(started) < 0.2
        gate.release()
        await asyncio.sleep(0.02)
        assert gate.lag.watchers == 0 and gate.lag._handle is None
        # Nothing held up after this instant.
        assert gate.lag.worst_since(asyncio.get_running_loop().time()) == 0.0


async def _reply_after(delay_s: float, timeout_s: float) -> str:
    """A stand-in for a Redis call whose reply arrives after ``delay_s``: read the way
    redis-py reads it, under an asyncio timeout, raising its ``TimeoutError``."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[str] = loop.create_future()
    loop.call_later(delay_s, reply.set_result, "OK")
    try:
        async with asyncio.timeout(timeout_s):
            return await reply
    except TimeoutError:
        raise RedisTimeoutError("Timeout reading from 127.0.0.1:6379") from None


class TestStoreCall:
    """``BudgetStore._call`` on a stand-in call: no Redis server needed."""

    @staticmethod
    def _store() -> BudgetStore:
        gate = Backpressure(slots=4, queue=4, wait_s=1.0, timeout_s=0.2)
        # Never connected: register_script only computes the script's SHA.
        return BudgetStore(aioredis.Redis(), "t:", refresh_s=1.0, down_s=5.0, backpressure=gate)

    async def test_a_reply_read_late_because_the_loop_was_held_up_is_overload(self) -> None:
        store = self._store()
        loop = asyncio.get_running_loop()
        # The reply arrives after 10 ms, but the loop is held for 0.3 s from 5 ms on (as
        # a burst of request handling would): the 0.2 s timer fires before the read.
        loop.call_later(0.005, time.sleep, 0.3)
        before = _overloaded("loop_lag")
        with pytest.raises(Overloaded, match="loop_lag"):
            await store._call("admit", lambda: _reply_after(0.01, 0.2))
        assert _overloaded("loop_lag") - before == 1
        assert not store.is_down
        assert store.backpressure.running == 0

    async def test_a_reply_that_never_comes_is_redis_failing(self) -> None:
        store = self._store()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            await store._call("admit", lambda: _reply_after(10.0, 0.2))
        assert store.is_down
        assert store.backpressure.running == 0

    async def test_a_quick_reply_passes(self) -> None:
        store = self._store()
        assert await store._call("admit", lambda: _reply_after(0.001, 0.2)) == "OK"
