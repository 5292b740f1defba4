"""The bounded outbound producer: its bound, its event-woken sender, and its flush."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from spendgate.admission.outbound import BoundedProducer
from spendgate.schemas.kafka_connect import KafkaConnection


class StubProducer:
    """Stands in for the aiokafka producer: records ``stop``."""

    stopped = False

    async def stop(self) -> None:
        self.stopped = True


class Recording(BoundedProducer[str]):
    """Each pass takes everything queued and holds one future per item, for the test to
    answer (``ack``) or fail (``fail``: the item is put back at the head and retried)."""

    def __init__(self, capacity: int, linger_s: float = 0.0) -> None:
        super().__init__("test producer", KafkaConnection(bootstrap="nowhere:1"), "t", capacity,
                         retry_s=0.01, linger_s=linger_s)  # fmt: skip
        self.passes: list[list[str]] = []
        self.sent: dict[str, asyncio.Future[None]] = {}
        self.stub = StubProducer()

    async def _start(self) -> AIOKafkaProducer:
        return self.stub  # type: ignore[return-value]

    async def _send_queued(self, producer: AIOKafkaProducer) -> None:
        taken = self._take(len(self._queue))
        self.passes.append([item for _, item in taken])
        for seq, item in taken:
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(lambda f, s=seq, i=item: self._answered(s, i, f))
            self.sent[item] = future

    def _answered(self, seq: int, item: str, future: asyncio.Future[None]) -> None:
        if future.exception() is not None:
            self._requeue(seq, item)
        else:
            self._settle((seq,))

    def ack(self, *items: str) -> None:
        for item in items:
            self.sent.pop(item).set_result(None)

    def fail(self, item: str) -> None:
        self.sent.pop(item).set_exception(RuntimeError("broker said no"))

    async def __aexit__(self, *exc: Any) -> None:
        await self._close(0.1)


async def _until(check: Any, timeout_s: float = 1.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - the test watches, the producer is not polled
            await asyncio.sleep(0.001)


class TestBound:
    def test_items_past_the_capacity_are_refused_without_a_running_loop(self) -> None:
        out = Recording(capacity=2)
        assert [out._accept(x) for x in "abc"] == [True, True, False]
        assert out.depth == 2 and not out.has_room()

    async def test_an_item_counts_against_the_bound_until_it_is_settled(self) -> None:
        async with Recording(capacity=2) as out:
            assert out._accept("a") and out._accept("b")
            await _until(lambda: len(out.sent) == 2)
            assert out.depth == 2 and not out._accept("c")  # in flight still counts
            out.fail("a")  # put back, not settled
            await _until(lambda: "a" in out.sent)  # its callback ran: sent again
            assert out.depth == 2 and not out._accept("c")
            out.ack("b")
            await _until(lambda: out.depth == 1)
            assert out._accept("c")


class TestWakeUp:
    async def test_an_idle_sender_makes_no_pass_and_one_item_wakes_it_at_once(self) -> None:
        async with Recording(capacity=10) as out:
            await asyncio.sleep(0.2)
            assert out.passes == []  # nothing queued: asleep on the event, no polling pass
            assert out._task is not None and not out._task.done()
            loop = asyncio.get_running_loop()
            started = loop.time()
            out._accept("a")
            await _until(lambda: out.passes == [["a"]])
            assert loop.time() - started < 0.05

    async def test_with_a_linger_what_arrives_meanwhile_goes_in_one_pass(self) -> None:
        async with Recording(capacity=10, linger_s=0.1) as out:
            out._accept("a")
            await asyncio.sleep(0.02)
            out._accept("b")
            out._accept("c")
            await _until(lambda: out.passes != [])
            await asyncio.sleep(0.05)
            assert out.passes == [["a", "b", "c"]]

    async def test_a_requeued_item_is_sent_again(self) -> None:
        async with Recording(capacity=10) as out:
            out._accept("a")
            await _until(lambda: "a" in out.sent)
            out.fail("a")
            await _until(lambda: len(out.passes) == 2)
            assert out.passes == [["a"], ["a"]]

    async def test_a_pass_failed_as_a_whole_is_sent_again_in_acceptance_order(self) -> None:
        async with Recording(capacity=10) as out:
            for item in "abc":
                out._accept(item)
            await _until(lambda: len(out.sent) == 3)
            for item in "abc":  # each callback puts its item back, first to last
                out.fail(item)
            await _until(lambda: sum(len(p) for p in out.passes) >= 6)
            assert [x for p in out.passes[1:] for x in p] == ["a", "b", "c"]


class TestFlush:
    async def test_flush_returns_once_what_was_accepted_before_it_is_settled(self) -> None:
        async with Recording(capacity=10) as out:
            out._accept("a")
            out._accept("b")
            flushing = asyncio.create_task(out.flush(5.0))
            await _until(lambda: len(out.sent) == 2)
            out._accept("late")  # accepted after the call: not waited for
            await _until(lambda: "late" in out.sent)
            out.ack("a")
            out.fail("b")  # retried: still waited for
            await asyncio.sleep(0.05)
            assert not flushing.done()
            await _until(lambda: "b" in out.sent)
            out.ack("b")
            assert await asyncio.wait_for(flushing, 1.0) is True
            assert out.depth == 1  # "late" is still in flight

    async def test_flush_gives_up_at_its_timeout(self) -> None:
        async with Recording(capacity=10) as out:
            out._accept("a")
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await out.flush(0.1) is False
            assert 0.1 <= loop.time() - started < 0.5
            assert out._flushes == []  # a flush that gave up leaves nothing behind
            out.ack("a")
            assert await out.flush(0.1) is True

    async def test_an_empty_buffer_flushes_at_once(self) -> None:
        out = Recording(capacity=1)
        assert await out.flush(0.0) is True

    async def test_closing_stops_the_sender_and_the_producer_within_its_bound(self) -> None:
        out = Recording(capacity=10)
        async with out:
            out._accept("a")  # never acked
            await _until(lambda: "a" in out.sent)
            loop = asyncio.get_running_loop()
            started = loop.time()
        assert loop.time() - started < 0.5
        assert out.stub.stopped and out._task is not None and out._task.done()
        assert out.depth == 1  # left for the owner to report

    async def test_closing_drains_what_is_accepted_while_it_waits(self) -> None:
        out = Recording(capacity=10)
        await out.__aenter__()
        out._accept("a")
        await _until(lambda: "a" in out.sent)
        closing = asyncio.create_task(out._close(5.0))
        out._accept("b")  # arrives during the drain
        await _until(lambda: "b" in out.sent)
        out.ack("a")
        await asyncio.sleep(0.05)
        assert not closing.done()  # "b" is still in flight
        out.ack("b")
        await asyncio.wait_for(closing, 1.0)
        assert out.depth == 0 and out.stub.stopped


class TestFullBufferSaysWhy:
    def test_a_full_buffer_is_one_warning_per_interval(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        producer = Recording(capacity=1)
        assert producer.has_room() and producer._accept("a")
        with caplog.at_level(logging.WARNING, "spendgate.admission.outbound"):
            assert not producer.has_room()
            assert not producer.has_room()
        lines = [r.getMessage() for r in caplog.records if "buffer is full" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "test producer" in lines[0] and "1 events not acked" in lines[0]
