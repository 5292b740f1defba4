"""Scenario 12: a commit or release answered 202 is in the log, even when admission dies.

On a private broker and Redis (``spendgate.devstack.LocalStack`` on free ports, started
by ``spendgate dev up`` in a child process): the broker is paused (SIGSTOP) while callers
commit and release through the Python client, the admission process is killed (kill -9)
and restarted on the same port, and the broker resumes (SIGCONT). Every settlement the
service answered 202 must be on the topic, and every one first answered 503 and retried
by the client must land too; counted by event id against what the test sent, and folded
by the worker's own pure code (``fan_out`` + ``apply``) into exactly the actual usage.
A SIGTERM with the broker paused lists exactly what was not acknowledged, none of it 202.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer

from spendgate.admission.client import AsyncAdmissionClient
from spendgate.admission.exceptions import AdmissionClientError
from spendgate.devstack import LocalStack, StackSettings
from spendgate.schemas.events import parse_event
from spendgate.schemas.policies import Policy
from spendgate.streams.dedupe import IdStore, Position
from spendgate.streams.kafka_util import assign, partitions, stop
from spendgate.streams.ledger import KeyState, apply
from tests.faults.conftest import AdmissionProc, AdmissionProcs, FaultRecord, write_policies
from tests.fixtures.admission import free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.fanout import fan_out

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
SCENARIO = 12
TOPICS = "d12."
KEYS = "d12:"
TENANT = "acme"
ESTIMATE = 1_000


def _dev(command: str, settings: StackSettings) -> None:
    """``spendgate dev <command>`` for the private stack, in a child process.

    In-process, ``LocalStack.up()`` would leave its ``Popen`` handles to the garbage
    collector, which warns (an error under this suite's warning filter).
    """
    env = {
        **os.environ,
        "SPENDGATE_KAFKA_PORT": str(settings.kafka_port),
        "SPENDGATE_KAFKA_CONTROLLER_PORT": str(settings.kafka_controller_port),
        "SPENDGATE_REDIS_PORT": str(settings.redis_port),
        "SPENDGATE_STACK_DIR": str(settings.stack_dir),
        "SPENDGATE_CACHE_DIR": str(settings.cache_dir),
    }
    done = subprocess.run(
        [sys.executable, "-m", "spendgate", "dev", command],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"spendgate dev {command} failed:\n{done.stdout}\n{done.stderr}")


@dataclass
class Stack:
    """The private broker and Redis, and the admission processes' shared settings."""

    local: LocalStack
    bootstrap: str
    redis_url: str

    def kafka_pid(self) -> int:
        pid = self.local.pid("kafka")
        assert pid is not None
        return pid


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """A private Kafka broker and Redis on free ports, stopped (and discarded) afterwards."""
    settings = StackSettings(
        kafka_port=free_port(),
        kafka_controller_port=free_port(),
        redis_port=free_port(),
        stack_dir=tmp_path / "stack",
        cache_dir=Path.home() / ".cache" / "spendgate",
    )
    local = LocalStack(settings)
    try:
        _dev("up", settings)
    except RuntimeError as exc:
        _dev("down", settings)
        pytest.fail(f"private Kafka/Redis did not start: {exc}")
    handle = Stack(local, f"127.0.0.1:{settings.kafka_port}",
                   f"redis://127.0.0.1:{settings.redis_port}/0")  # fmt: skip
    yield handle
    pid = local.pid("kafka")
    if pid is not None:
        os.kill(pid, signal.SIGCONT)  # a paused broker would not hear the SIGTERM
    _dev("down", settings)


def _start(procs: AdmissionProcs, stack: Stack, name: str, port: int, **env: str) -> AdmissionProc:
    """A real ``spendgate admission`` process on ``port`` (stopped with ``procs``).

    The port is chosen by the test, so a restarted process answers where the client's
    retries already go.
    """
    full = {
        **os.environ,
        "SPENDGATE_KAFKA_BOOTSTRAP": stack.bootstrap,
        "SPENDGATE_REDIS_URL": stack.redis_url,
        "SPENDGATE_TOPIC_PREFIX": TOPICS,
        "SPENDGATE_REDIS_PREFIX": KEYS,
        "SPENDGATE_ADMISSION_HOST": "127.0.0.1",
        "SPENDGATE_ADMISSION_PORT": str(port),
        "SPENDGATE_POLICY_REFRESH_S": "0.1",
        # The machine is shared and small: a slow Redis answer is not an outage here.
        "SPENDGATE_REDIS_TIMEOUT_S": "2.0",
        **env,
    }
    log = procs.logs / f"admission-{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "spendgate", "admission"], env=full,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    handle = AdmissionProc(name, f"http://127.0.0.1:{port}", proc, log)
    procs.started.append(handle)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"admission {name} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{handle.url}/healthz", timeout=1).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"admission {name} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)


@dataclass
class Tally:
    """Every answer the service gave, per reservation, as the client's transport saw it."""

    answers: dict[str, list[int | str]] = field(default_factory=dict)

    def add(self, rid: str, answer: int | str) -> None:
        self.answers.setdefault(rid, []).append(answer)

    def count(self, answer: int | str) -> int:
        return sum(a.count(answer) for a in self.answers.values())


class TallyTransport(httpx.AsyncHTTPTransport):
    """Notes the status (or the connection error) of every commit and release try."""

    def __init__(self, tally: Tally) -> None:
        super().__init__(limits=httpx.Limits(max_connections=300))
        self.tally = tally
        self.inflight = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        found = re.search(rb'"reservation_id":\s*"([0-9a-f]+)"', request.content)
        rid = found.group(1).decode() if found else "?"
        self.inflight += 1
        try:
            response = await super().handle_async_request(request)
        except httpx.TransportError as exc:
            self.tally.add(rid, type(exc).__name__)
            raise
        finally:
            self.inflight -= 1
        self.tally.add(rid, response.status_code)
        return response


async def _topic(bootstrap: str, topic: str) -> list[tuple[bytes, Position]]:
    """Every (value, position and broker timestamp) of ``topic``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = await partitions(consumer, topic)
        if not tps:
            return []
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[tuple[bytes, Position]] = []
        while [tp for tp in tps if await consumer.position(tp) < end[tp]]:
            batch = await consumer.getmany(*tps, timeout_ms=500)
            for messages in batch.values():
                out += [
                    (m.value or b"", Position(m.partition, m.offset, m.timestamp)) for m in messages
                ]
        return out
    finally:
        await stop(consumer)


async def _until(
    what: str, check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 120.0
) -> None:
    """Wait until ``check`` holds (a condition, polled), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def _event_ids(bootstrap: str) -> Counter[str]:
    return Counter(parse_event(v).event_id for v, _pos in await _topic(bootstrap, f"{TOPICS}usage"))


def _amounts(records: Sequence[tuple[bytes, object]]) -> dict[str, set[int | None]]:
    """event id -> every ``input_tokens`` its copies on the topic carry (read as JSON)."""
    out: dict[str, set[int | None]] = {}
    for raw, _pos in records:
        body = json.loads(raw)
        out.setdefault(body["event_id"], set()).add((body.get("usage") or {}).get("input_tokens"))
    return out


def _fold(records: list[tuple[bytes, Position]], policy: Policy) -> tuple[int, Counter[str]]:
    """The window total the worker's pure fold computes from the log, and its outcomes
    (``duplicate`` for producer duplicates the id set drops)."""
    state, outcomes = KeyState(), Counter[str]()
    ids = IdStore(None, 86_400_000)
    try:
        for raw, pos in records:
            out = fan_out(raw, broker_ms=pos.arrival_ms, policies=[policy], prices=None,
                          max_future_skew_ms=300_000, src=pos, ids=ids)  # fmt: skip
            ids.advance(pos)
            if out.duplicate:
                outcomes["duplicate"] += 1
            for rec in out.records:
                outcomes[apply(state, rec).outcome] += 1
    finally:
        ids.close()
    return sum(state.buckets.values()), outcomes


def _policy(policy_factory: PolicyFactory) -> Policy:
    return policy_factory(id="d12", unit="input_tokens", limit=10**12, window="1h",
                          bucket="1m", group_by=["tenant"], failure="closed")  # fmt: skip


async def _admit(http: httpx.AsyncClient, n: int) -> list[str]:
    rids = []
    for _ in range(n):
        answer = await http.post("/v1/admit", json={
            "request_id": uuid.uuid4().hex, "subject": {"tenant": TENANT, "model": "m"},
            "estimate": {"input_tokens": ESTIMATE}})  # fmt: skip
        assert answer.status_code == 200, answer.text
        rids.append(answer.json()["reservation_id"])
    return rids


class TestDurableSettlements:
    async def test_paused_broker_kill_9_and_resume_lose_no_accepted_settlement(
        self,
        stack: Stack,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        policy = _policy(policy_factory)
        await write_policies(stack.redis_url, KEYS, policy)
        port = free_port()
        first = _start(admission_procs, stack, "a1", port)
        async with httpx.AsyncClient(base_url=first.url, timeout=30) as http:
            rids = await _admit(http, 220)
        # Actual usage differs per reservation, so the final window names what counted.
        actual = {rid: 1 + i for i, rid in enumerate(rids)}
        release = {rid for i, rid in enumerate(rids) if i % 5 == 4}
        want = {f"reserve-{r}" for r in rids}
        await _until("every reserve on the topic",
                     lambda: _has(stack.bootstrap, want), 60)  # fmt: skip
        tally = Tally()
        final: dict[str, str] = {}
        transport = TallyTransport(tally)
        client = AsyncAdmissionClient(
            first.url, timeout_s=10, retries=60, backoff_s=0.05, max_backoff_s=1.0,
            transport=transport,
        )  # fmt: skip

        async def settle(rid: str) -> None:
            try:
                if rid in release:
                    await client.release(rid)
                else:
                    await client.commit(rid, {"input_tokens": actual[rid]})
                final[rid] = "202"
            except AdmissionClientError as exc:
                final[rid] = f"gave up: {exc}"

        settled_before = rids[:20]
        await asyncio.gather(*(settle(r) for r in settled_before))
        fault_record.fault("20 settlements with the broker up (answered 202)")
        os.kill(stack.kafka_pid(), signal.SIGSTOP)
        fault_record.fault("own Kafka broker paused (SIGSTOP)")
        during = rids[20:]
        tasks = []
        for rid in during:  # staggered, so the kill finds tries waiting for their ack
            tasks.append(asyncio.create_task(settle(rid)))
            await asyncio.sleep(0.015)
        await _until("100 answers 503 and 50 tries waiting for an ack",
                     lambda: tally.count(503) >= 100 and transport.inflight >= 50, 60)  # fmt: skip
        await asyncio.sleep(0.5)  # past any burst of answers already on their way
        inflight = transport.inflight
        first.proc.kill()
        first.proc.wait()
        fault_record.fault(f"200 settlements sent; admission killed (kill -9) after "
                           f"{tally.count(503)} answers 503 outcome_unknown, with {inflight} "
                           f"tries waiting for their ack")  # fmt: skip
        # In a thread: the clients' tries go on (refused) while the new process starts.
        second = await asyncio.to_thread(_start, admission_procs, stack, "a2", port)
        fault_record.fault("admission restarted on the same port (broker still paused)")
        os.kill(stack.kafka_pid(), signal.SIGCONT)
        fault_record.fault("broker resumed (SIGCONT); the client keeps retrying by itself")
        await asyncio.gather(*tasks)
        await client.aclose()
        accepted = {r for r in rids if final.get(r) == "202"}
        first_try = {r for r in accepted if tally.answers[r] == [202]}
        kind = {r: "release" if r in release else "commit" for r in rids}
        wanted = {f"{kind[r]}-{r}" for r in accepted}
        records: list[tuple[bytes, Position]] = []
        try:
            await _until("every accepted settlement on the topic",
                         lambda: _has(stack.bootstrap, wanted), 120)  # fmt: skip
        finally:
            records = await _topic(stack.bootstrap, f"{TOPICS}usage")
            on_topic = Counter(parse_event(v).event_id for v, _pos in records)
            total, outcomes = _fold(records, policy)
            answers = Counter(str(a) for v in tally.answers.values() for a in v)
            expected_total = sum(actual[r] for r in accepted if r not in release)
            expected_total += sum(ESTIMATE for r in rids if r not in accepted)
            fault_record.add(
                events_checked=len(records),
                reservations=len(rids),
                settlements_sent=len(rids),
                answered_202_finally=len(accepted),
                answered_202_first_try=len(first_try),
                answers_503=tally.count(503),
                answers=dict(answers),
                client_gave_up=len(rids) - len(accepted),
                accepted_missing_from_topic=len(wanted - set(on_topic)),
                first_try_records_not_exactly_one=sum(
                    on_topic[f"{kind[r]}-{r}"] != 1 for r in first_try),
                duplicate_records_on_topic=sum(n - 1 for n in on_topic.values()),
                fold_outcomes=dict(outcomes),
                window_total=total,
                window_total_expected=expected_total,
                units_lost=max(0, expected_total - total),
                units_double_counted=max(0, total - expected_total),
            )  # fmt: skip
            fault_record.inputs.append(f"{second.name} log: {second.log}")
        assert accepted == set(rids), {r: final.get(r) for r in set(rids) - accepted}
        assert tally.count(503) >= 100
        # Every try the client made was answered or cut by the kill; each settlement ends on
        # exactly one 202 (the client stops there).
        assert answers["202"] == len(rids)
        assert set(answers) <= {"202", "503", "ConnectError", "RemoteProtocolError",
                                "ReadError", "WriteError"}, answers  # fmt: skip
        # Only the 20 settled with the broker up were accepted at their first try: every
        # one sent while it was paused waited for an ack that could not come.
        assert first_try == set(settled_before)
        # Counted on the topic against what the test sent: every event the test caused is
        # there and nothing else; one accepted at its first try exactly once; a copy beyond
        # the first only of a settlement the client tried more than once (a try cut by the
        # kill may have reached the log too: same event id).
        assert set(on_topic) == want | wanted
        # Every copy carries what the test sent for that event: a copy is the same event.
        sent: dict[str, set[int | None]] = {f"reserve-{r}": {ESTIMATE} for r in rids}
        sent |= {f"{kind[r]}-{r}": {None} if r in release else {actual[r]} for r in rids}
        assert _amounts(records) == sent
        assert all(on_topic[f"{kind[r]}-{r}"] == 1 for r in first_try)
        assert all(len(tally.answers[e.split("-", 1)[1]]) > 1
                   for e, n in on_topic.items() if n > 1)  # fmt: skip
        # The fold drops exactly those copies and applies every event the test sent once.
        assert outcomes["duplicate"] == sum(n - 1 for n in on_topic.values())
        assert sum(outcomes.values()) - outcomes["duplicate"] == len(want | wanted)
        assert total == expected_total

    async def test_broker_down_30s_under_steady_load_loses_and_doubles_nothing(
        self,
        stack: Stack,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        policy = _policy(policy_factory)
        await write_policies(stack.redis_url, KEYS, policy)
        proc = _start(admission_procs, stack, "s1", free_port())
        tally = Tally()
        client = AsyncAdmissionClient(
            proc.url, timeout_s=10, retries=80, backoff_s=0.05, max_backoff_s=1.0,
            transport=TallyTransport(tally),
        )  # fmt: skip
        admitted: dict[str, int] = {}  # reservation id -> actual usage committed (0: release)
        final: dict[str, str] = {}
        refused: Counter[str] = Counter()

        async def one(i: int) -> None:
            try:
                decision = await client.admit({"tenant": TENANT, "model": "m"},
                                              {"input_tokens": ESTIMATE})  # fmt: skip
            except AdmissionClientError as exc:
                refused[type(exc).__name__] += 1
                return
            assert decision.reservation_id is not None
            rid = decision.reservation_id
            admitted[rid] = 0 if i % 5 == 4 else 1 + i
            try:
                if admitted[rid]:
                    await client.commit(rid, {"input_tokens": admitted[rid]})
                else:
                    await client.release(rid)
                final[rid] = "202"
            except AdmissionClientError as exc:
                final[rid] = f"gave up: {exc}"

        tasks: list[asyncio.Task[None]] = []
        stop_load = asyncio.Event()

        async def load() -> None:
            i = 0
            while not stop_load.is_set():  # steady: 10 generations a second
                tasks.append(asyncio.create_task(one(i)))
                i += 1
                await asyncio.sleep(0.1)

        loader = asyncio.create_task(load())
        await _until("50 settlements accepted with the broker up",
                     lambda: len(final) >= 50, 60)  # fmt: skip
        os.kill(stack.kafka_pid(), signal.SIGKILL)
        down_at = time.monotonic()
        fault_record.fault("own Kafka broker killed (SIGKILL) under steady load (10 admits/s, "
                           "each committed or released)")  # fmt: skip
        accepted_before = len(final)
        await asyncio.sleep(30)  # the outage itself is the fault injected: 30 s down
        await asyncio.to_thread(_dev, "up", stack.local.settings)
        fault_record.fault(f"broker restarted after {time.monotonic() - down_at:.0f} s down "
                           f"(same data directory)")  # fmt: skip
        await _until("50 more settlements accepted after the restart",
                     lambda: sum(v == "202" for v in final.values()) >= accepted_before + 50,
                     180)  # fmt: skip
        stop_load.set()
        await loader
        await asyncio.gather(*tasks)
        await client.aclose()
        accepted = {r for r, v in final.items() if v == "202"}
        wanted = {f"reserve-{r}" for r in admitted}
        wanted |= {f"{'commit' if admitted[r] else 'release'}-{r}" for r in accepted}
        records: list[tuple[bytes, Position]] = []
        try:
            await _until("every accepted event on the topic",
                         lambda: _has(stack.bootstrap, wanted), 180)  # fmt: skip
        finally:
            records = await _topic(stack.bootstrap, f"{TOPICS}usage")
            on_topic = Counter(parse_event(v).event_id for v, _pos in records)
            total, outcomes = _fold(records, policy)
            expected_total = sum(admitted[r] if r in accepted else ESTIMATE for r in admitted)
            fault_record.add(
                events_checked=len(records),
                generations=len(tasks),
                admits_refused=dict(refused),
                admitted=len(admitted),
                settlements_answered_202=len(accepted),
                answers_503=tally.count(503),
                client_gave_up=len(admitted) - len(accepted),
                accepted_events=len(wanted),
                accepted_missing_from_topic=len(wanted - set(on_topic)),
                duplicate_records_on_topic=sum(n - 1 for n in on_topic.values()),
                fold_outcomes=dict(outcomes),
                window_total=total,
                window_total_expected=expected_total,
                units_lost=max(0, expected_total - total),
                units_double_counted=max(0, total - expected_total),
            )
        assert not refused, refused
        assert accepted == set(admitted), {r: final.get(r) for r in set(admitted) - accepted}
        assert tally.count(503) > 0  # the outage was felt by the settlements
        # Counted on the topic against what the test sent: every event it caused is there
        # and nothing else. A copy beyond the first is a reserve (buffered while Kafka was
        # down and also republished by the sweeper) or a settlement the client tried more
        # than once; the fold drops exactly those copies and applies each event once.
        assert set(on_topic) == wanted
        # Every copy carries what the test sent for that event: a copy is the same event.
        sent: dict[str, set[int | None]] = {f"reserve-{r}": {ESTIMATE} for r in admitted}
        sent |= {f"{'commit' if a else 'release'}-{r}": {a or None} for r, a in admitted.items()}
        assert _amounts(records) == sent
        assert all(e.startswith("reserve-") or len(tally.answers[e.split("-", 1)[1]]) > 1
                   for e, n in on_topic.items() if n > 1)  # fmt: skip
        assert outcomes["duplicate"] == sum(n - 1 for n in on_topic.values())
        assert sum(outcomes.values()) - outcomes["duplicate"] == len(wanted)
        assert total == expected_total

    async def test_sigterm_with_the_broker_paused_lists_what_was_not_acked(
        self,
        stack: Stack,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        policy = _policy(policy_factory)
        await write_policies(stack.redis_url, KEYS, policy)
        proc = _start(admission_procs, stack, "t1", free_port(),
                      SPENDGATE_SHUTDOWN_PUBLISH_S="3")  # fmt: skip
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            before = await _admit(http, 10)
            for rid in before:
                body = {"reservation_id": rid, "usage": {"input_tokens": 1}}
                assert (await http.post("/v1/commit", json=body)).status_code == 202
            os.kill(stack.kafka_pid(), signal.SIGSTOP)
            fault_record.fault("own Kafka broker paused (SIGSTOP)")
            paused = await _admit(http, 15)
            unknown = []
            for rid in paused[:5]:
                body = {"reservation_id": rid, "usage": {"input_tokens": 1}}
                answer = await http.post("/v1/commit", json=body)
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "outcome_unknown"
                unknown.append(f"commit-{rid}")
        fault_record.fault("15 admits (200) and 5 commits (503) while paused; then SIGTERM")
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(timeout=30)
        took = time.monotonic() - started
        log = proc.log.read_text()
        found = re.search(r"(\d+) events were not acknowledged by Kafka before shutdown "
                          r"\(([^)]*)\)", log)  # fmt: skip
        listed: set[str] = set()
        for line in re.findall(r"unpublished event ids: (.*)", log):
            listed |= set(line.split())
        answered_202 = {f"commit-{r}" for r in before}
        fault_record.add(
            events_checked=len(listed),
            shutdown_seconds=round(took, 1),
            exit_code=code,
            reported=found.group(0) if found else None,
            listed_ids=len(listed),
            expected_ids=len(paused) + len(unknown),
            answered_202_among_listed=len(listed & answered_202),
        )
        # Ended by itself on the SIGTERM the test sent (not killed, not a crash on the way out).
        assert code in (0, -signal.SIGTERM), code
        assert took < 3 + 10
        assert found is not None, log[-3000:]
        assert found.group(2) == "commit=5, reserve=15"
        assert listed == {f"reserve-{r}" for r in paused} | set(unknown)
        assert not listed & answered_202


async def _has(bootstrap: str, wanted: set[str]) -> bool:
    return wanted <= set(await _event_ids(bootstrap))
