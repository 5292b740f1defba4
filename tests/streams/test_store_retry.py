"""A Redis error in the worker's agents and timers is a retry, never a crash (issue 40)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ClusterDownError
from redis.exceptions import ConnectionError as RedisConnectionError

from spendgate.schemas.backoff import Backoff
from spendgate.streams.drift import DriftCheck
from spendgate.streams.ledger import KeyState
from spendgate.streams.retry import StoreRetry, commit_until_written


def _errors(task: str) -> float:
    value = REGISTRY.get_sample_value("spendgate_worker_store_errors_total", {"task": task})
    return value or 0.0


def _event(partition: int, offset: int) -> Any:
    tp = ("usage", partition)
    return SimpleNamespace(message=SimpleNamespace(tp=tp, partition=partition, offset=offset))


class Clock:
    """A monotonic clock that only moves when slept on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.slept.append(round(s, 3))
        self.now += s


class Flaky:
    """A batch commit that raises ``errors`` in turn, then succeeds."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.attempts: list[list[Any]] = []

    async def run(self, events: Sequence[Any]) -> None:
        self.attempts.append(list(events))
        if self.errors:
            raise self.errors.pop(0)


class TestBackoff:
    def test_doubles_from_a_tenth_of_a_second_to_five_and_starts_over(self) -> None:
        b = Backoff()
        assert [b.failed() for _ in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
        assert b.succeeded() == 8
        assert b.failed() == 0.1

    def test_refuses_bounds_that_cannot_hold(self) -> None:
        with pytest.raises(ValueError, match="first_s"):
            Backoff(1.0, 0.5)


class TestCommitUntilWritten:
    async def test_a_batch_is_committed_again_after_each_store_error(self) -> None:
        clock = Clock()
        retry = StoreRetry("t-again", clock=clock, sleep=clock.sleep)
        commit = Flaky(RedisConnectionError("refused"), ClusterDownError("failover"))
        events = [_event(0, 1), _event(1, 7)]
        before = _errors("t-again")
        owned = {("usage", 0), ("usage", 1)}
        written = await commit_until_written(
            commit.run, events, retry, owned=lambda: owned, rebalancing=lambda: False
        )
        assert written
        assert len(commit.attempts) == 3 and all(a == events for a in commit.attempts)
        assert clock.slept == [0.1, 0.2]
        assert _errors("t-again") - before == 2
        assert retry.backoff.failures == 0  # a success starts the delays over

    async def test_events_of_partitions_gone_are_dropped_between_attempts(self) -> None:
        clock = Clock()
        retry = StoreRetry("t-moved", clock=clock, sleep=clock.sleep)
        commit = Flaky(RedisConnectionError("refused"))
        events = [_event(0, 1), _event(1, 7), _event(0, 2)]
        owned = {("usage", 0)}
        assert await commit_until_written(
            commit.run, events, retry, owned=lambda: owned, rebalancing=lambda: False
        )
        assert [e.message.offset for e in commit.attempts[1]] == [1, 2]

    async def test_a_rebalance_gives_the_batch_up_unacked(self) -> None:
        clock = Clock()
        retry = StoreRetry("t-rebalance", clock=clock, sleep=clock.sleep)
        commit = Flaky(RedisConnectionError("refused"))
        events = [_event(0, 1)]
        written = await commit_until_written(
            commit.run, events, retry, owned=lambda: {("usage", 0)}, rebalancing=lambda: True
        )
        assert not written
        assert events == []  # let go: faust's wait for acks sees them gone
        assert len(commit.attempts) == 1

    async def test_any_other_error_is_raised(self) -> None:
        retry = StoreRetry("t-other")
        commit = Flaky(KeyError("not a store error"))
        with pytest.raises(KeyError):
            await commit_until_written(
                commit.run, [_event(0, 1)], retry, owned=set, rebalancing=lambda: False
            )


class _Table(dict[str, bytes]):
    pass


class TestDriftTimer:
    def _drift(self, heal: Any, clock: Clock) -> DriftCheck:
        now = int(time.time() * 1000) // 60_000 * 60_000
        state = KeyState(buckets={now: 5}, bucket_ms=60_000, window_ms=3_600_000)
        table = _Table({"p|tenant=a": state.to_bytes()})
        ready = asyncio.Event()
        ready.set()
        app = SimpleNamespace(tables=SimpleNamespace(recovery=None))
        book = SimpleNamespace(ready=ready)
        materializer = SimpleNamespace(heal_many=heal)
        retry = StoreRetry("t-drift", clock=clock, sleep=clock.sleep)
        return DriftCheck(app, table, book, materializer, 10, set(), retry)  # type: ignore[arg-type]

    async def test_a_store_error_is_counted_and_the_ticks_wait_out_the_backoff(self) -> None:
        calls: list[int] = []
        failing = [True]

        async def heal_many(states: Sequence[Any]) -> list[bool]:
            calls.append(len(states))
            if failing[0]:
                raise RedisConnectionError("Error 111 connecting")
            return [False] * len(states)

        clock = Clock()
        drift = self._drift(heal_many, clock)
        before = _errors("t-drift")
        await drift.tick()  # raises nothing: the timer (and the app) live
        assert _errors("t-drift") - before == 1
        await drift.tick()  # within the 0.1 s backoff: skipped
        assert calls == [1]
        clock.now += 0.1
        failing[0] = False
        await drift.tick()
        assert calls == [1, 1]
        assert drift.retry.backoff.failures == 0
