"""The worker's liveness, watchdog and bounds (issue 52): what /healthz and the self-exit
conclude from the progress they are told of, and the settings that order the bounds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from spendgate.schemas.exceptions import ConfigurationError
from spendgate.streams.exceptions import KafkaWaitExpired
from spendgate.streams.health import WorkerHealth
from spendgate.streams.health_server import HealthServer
from spendgate.streams.kafka_util import ReadBound
from spendgate.streams.liveness import EXIT_STALLED, Liveness
from spendgate.streams.retry import StoreRetry, commit_until_written
from spendgate.streams.settings import load_settings
from spendgate.streams.watchdog import Watchdog
from tests.streams.test_commit import BATCH, REMOTE, Rig
from tests.streams.test_store_retry import Clock, Flaky, _event


class TestLiveness:
    def test_an_idle_worker_is_healthy_however_long_it_waits(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        for _ in range(100):
            clock.now += 1.0
            live.beat()
        assert live.verdict().healthy
        assert live.must_exit().healthy

    def test_a_batch_without_progress_is_a_stall_then_an_exit(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        live.took("split", 12)
        clock.now = 1.9
        live.beat()
        assert live.verdict().healthy
        clock.now = 2.1
        live.beat()
        stalled = live.verdict()
        assert not stalled.healthy
        assert stalled.reason is not None and "agent split holds a batch of 12 records" in (
            stalled.reason
        )
        assert stalled.body()["status"] == "stalled"
        assert live.must_exit().healthy
        clock.now = 5.1
        live.beat()
        assert not live.must_exit().healthy

    def test_progress_starts_the_clock_over_and_done_ends_it(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        live.took("account", 3)
        clock.now = 1.5
        live.progressed("account")
        clock.now = 3.0
        live.beat()
        assert live.verdict().healthy
        clock.now = 3.6
        live.beat()
        assert not live.verdict().healthy
        live.done("account")
        assert live.verdict().healthy

    def test_a_backoff_ahead_is_no_stall(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        live.took("split", 1)
        live.progressed("split", ahead_s=5.0)  # the store's backoff: 5 s before the retry
        clock.now = 6.9
        live.beat()
        assert live.verdict().healthy and live.must_exit().healthy
        clock.now = 7.1
        live.beat()
        assert not live.verdict().healthy

    def test_a_loop_that_does_not_beat_is_a_stall(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        clock.now = 2.5
        verdict = live.verdict()
        assert not verdict.healthy
        assert verdict.reason == "the event loop has not run for 2.5 s"

    def test_a_noted_wait_is_judged_until_it_ends(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        live.waiting("the commit")
        clock.now = 1.0
        live.waiting("the commit")  # the first instant holds
        clock.now = 2.5
        live.beat()
        assert live.verdict().reason == "the commit has waited 2.5 s"
        live.ended("the commit")
        assert live.verdict().healthy

    def test_refuses_bounds_out_of_order(self) -> None:
        with pytest.raises(ValueError, match="stall_s < exit_s"):
            Liveness(5.0, 5.0)


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []

    def __call__(self, code: int) -> None:
        self.codes.append(code)


def _bound_hits(wait: str) -> float:
    return REGISTRY.get_sample_value("spendgate_worker_bound_hits_total", {"wait": wait}) or 0.0


class TestWatchdog:
    def test_a_stall_is_logged_once_with_diagnostics_then_the_process_exits_4(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        exits = Exits()
        reports: list[str] = []
        dog = Watchdog(live, lambda why: reports.append(why) or f"report: {why}", exit=exits)
        before = _bound_hits("progress")
        live.took("split", 1)
        with caplog.at_level(logging.ERROR):
            clock.now = 2.5
            live.beat()
            dog.check()
            dog.check()
            assert exits.codes == []
            assert _bound_hits("progress") == before + 1
            assert REGISTRY.get_sample_value("spendgate_worker_stalled") == 1
            assert len(reports) == 1 and "agent split" in reports[0]
            clock.now = 5.5
            live.beat()
            dog.check()
        assert exits.codes == [EXIT_STALLED]
        assert "worker exits 4: no progress" in caplog.text
        assert len(reports) == 2

    def test_progress_again_clears_the_stall(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        dog = Watchdog(live, lambda why: why, exit=Exits())
        live.took("split", 1)
        clock.now = 2.5
        live.beat()
        dog.check()
        live.done("split")
        dog.check()
        assert REGISTRY.get_sample_value("spendgate_worker_stalled") == 0

    def test_a_stop_that_outlasts_its_grace_exits_4(self) -> None:
        clock = Clock()
        live = Liveness(20.0, 50.0, clock)
        exits = Exits()
        dog = Watchdog(live, lambda why: why, exit=exits, clock=clock)
        dog.stopping(3.0)
        clock.now = 2.0
        live.beat()
        dog.stopping(3.0)  # a second signal does not move the deadline
        dog.check()
        assert exits.codes == []
        clock.now = 3.1
        live.beat()
        dog.check()
        assert exits.codes == [EXIT_STALLED]


class Never:
    """An outbox whose acks never come (a produce request with no answer)."""

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[Any]] = []

    async def _never(self) -> Awaitable[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        return fut

    async def keyed(self, batch: Any) -> Awaitable[Any]:
        return await self._never()

    async def dead_letter(self, refusal: Any) -> Awaitable[Any]:
        return await self._never()

    async def alert(self, alert: Any) -> Awaitable[Any]:
        return await self._never()


class TestBoundedSends:
    async def test_sends_never_acked_raise_within_the_bound_and_are_not_cancelled(
        self,
    ) -> None:
        rig = Rig(policies=(REMOTE,))
        never = Never()
        rig.commit.outbox = never
        rig.commit.kafka_wait_s = 0.2
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(KafkaWaitExpired) as raised:
            await rig.commit.run(BATCH)
        assert raised.value.wait == "sends"
        assert "SPENDGATE_WORKER_KAFKA_WAIT_S" in str(raised.value)
        assert 0.2 <= loop.time() - began < 1.0
        assert len(never.futures) == 2 and not any(f.cancelled() for f in never.futures)
        # Nothing after the sends: no mark, no offset, the state forgotten for the retry.
        assert rig.rec.steps()[-1] == "forget"
        assert not rig.rec.of("marks") and not rig.rec.of("offsets") and not rig.done

    async def test_changelog_writes_not_drained_within_the_bound_raise(self) -> None:
        rig = Rig()

        class Stuck:
            async def commit(self, events: Sequence[Any]) -> None:
                await asyncio.sleep(30)

        rig.commit.offsets = Stuck()
        rig.commit.kafka_wait_s = 0.1
        with pytest.raises(KafkaWaitExpired) as raised:
            await rig.commit.run(BATCH)
        assert raised.value.wait == "offsets"

    async def test_a_batch_past_the_bound_is_committed_again_until_written(self) -> None:
        clock = Clock()
        retry = StoreRetry("t-bound", clock=clock, sleep=clock.sleep)
        live = Liveness(2.0, 5.0, clock)
        hits: list[KafkaWaitExpired] = []
        commit = Flaky(KafkaWaitExpired("sends", "no acks"), KafkaWaitExpired("sends", "again"))
        resends = REGISTRY.get_sample_value("spendgate_worker_resends_total") or 0.0
        before = _bound_hits("sends")
        events = [_event(0, 1)]
        written = await commit_until_written(
            commit.run,
            events,
            retry,
            owned=lambda: {("usage", 0)},
            rebalancing=lambda: False,
            liveness=live,
            bound_hit=hits.append,
        )
        assert written and len(commit.attempts) == 3
        assert len(hits) == 2
        assert _bound_hits("sends") == before + 2
        assert REGISTRY.get_sample_value("spendgate_worker_resends_total") == resends + 2
        assert live.held() == {}

    async def test_a_store_error_is_progress_a_kafka_bound_is_not(self) -> None:
        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        seen: list[float] = []

        class Probe:
            def __init__(self, error: BaseException) -> None:
                self.error: BaseException | None = error

            async def run(self, events: Sequence[Any]) -> None:
                seen.append(live.held()["t-progress"].progress)
                clock.now += 1.0
                if self.error is not None:
                    error, self.error = self.error, None
                    raise error

        from redis.exceptions import ConnectionError as RedisConnectionError

        for error, moved in (
            (RedisConnectionError("down"), True),
            (KafkaWaitExpired("sends", "x"), False),
        ):
            seen.clear()
            clock.now = 0.0
            retry = StoreRetry("t-progress", clock=clock, sleep=clock.sleep)
            await commit_until_written(
                Probe(error).run,
                [_event(0, 1)],
                retry,
                owned=lambda: {("usage", 0)},
                rebalancing=lambda: False,
                liveness=live,
            )
            assert (seen[1] > seen[0]) is moved, (error, seen)


class TestReadBound:
    def test_no_record_within_the_bound_expires_records_are_progress(self) -> None:
        clock = Clock()
        progressed: list[bool] = []
        bound = ReadBound(2.0, lambda: progressed.append(True), clock=clock)
        clock.now = 1.5
        bound.read(10, "reading")
        clock.now = 3.0
        bound.read(0, "reading")
        assert progressed == [True]
        clock.now = 3.6
        with pytest.raises(KafkaWaitExpired, match="reading: no record arrived"):
            bound.read(0, "reading")

    async def test_a_step_past_the_bound_expires(self) -> None:
        bound = ReadBound(0.05)
        with pytest.raises(KafkaWaitExpired) as raised:
            await bound.step("asking offsets", asyncio.sleep(5))
        assert raised.value.wait == "read_back"


class TestHealthz:
    def test_answers_503_with_the_reason_while_stalled(self) -> None:
        import httpx

        clock = Clock()
        live = Liveness(2.0, 5.0, clock)
        server = HealthServer(WorkerHealth(), 0, liveness=live).start()
        try:
            url = f"http://127.0.0.1:{server.port}/healthz"
            assert httpx.get(url).json() == {"status": "ok"}
            live.took("split", 4)
            clock.now = 3.0
            live.beat()
            answer = httpx.get(url)
            assert answer.status_code == 503
            assert answer.json()["status"] == "stalled"
            assert "agent split holds a batch of 4 records" in answer.json()["reason"]
        finally:
            server.stop()


class TestSettings:
    @pytest.mark.parametrize(
        ("env", "message"),
        [
            (
                {"SPENDGATE_WORKER_KAFKA_WAIT_S": "0"},
                "SPENDGATE_WORKER_KAFKA_WAIT_S must be above 0",
            ),
            ({"SPENDGATE_WORKER_STALL_S": "-1"}, "SPENDGATE_WORKER_STALL_S must be above 0"),
            (
                {"SPENDGATE_WORKER_KAFKA_WAIT_S": "50", "SPENDGATE_WORKER_STALL_S": "40"},
                "SPENDGATE_WORKER_STALL_S (40.0) must be at least SPENDGATE_WORKER_KAFKA_WAIT_S",
            ),
            (
                {"SPENDGATE_WORKER_STALL_S": "60", "SPENDGATE_WORKER_EXIT_S": "50"},
                "SPENDGATE_WORKER_EXIT_S (50.0) must be above SPENDGATE_WORKER_STALL_S (60.0)",
            ),
            (
                {"SPENDGATE_WORKER_STOP_GRACE_S": "15"},
                "SPENDGATE_WORKER_STOP_GRACE_S (15.0) must be below SPENDGATE_SESSION_TIMEOUT_S",
            ),
            ({"SPENDGATE_SESSION_TIMEOUT_S": "1"}, "SPENDGATE_SESSION_TIMEOUT_S: Input should be"),
        ],
    )
    def test_refused_with_one_line_naming_the_variable(
        self, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
    ) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ConfigurationError) as refused:
            load_settings()
        assert message in str(refused.value)
        assert "\n" not in str(refused.value)

    def test_the_default_grace_follows_a_short_session_timeout(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("SPENDGATE_SESSION_TIMEOUT_S", "6")
        assert load_settings().worker_stop_grace_s == 4.0
        monkeypatch.setenv("SPENDGATE_WORKER_STOP_GRACE_S", "6")
        with pytest.raises(ConfigurationError, match="must be below SPENDGATE_SESSION_TIMEOUT_S"):
            load_settings()

    def test_the_defaults_hold(self) -> None:
        settings = load_settings()
        assert (
            settings.worker_kafka_wait_s,
            settings.worker_stall_s,
            settings.worker_exit_s,
            settings.worker_stop_grace_s,
        ) == (30.0, 45.0, 120.0, 10.0)


def test_the_stall_exit_code_is_its_own() -> None:
    # 0 a stop, 1 a failure or a stop no signal asked for, 2 a refused setting, 3 a timeout.
    assert EXIT_STALLED == 4
    assert SimpleNamespace(code=EXIT_STALLED).code not in (0, 1, 2, 3)
