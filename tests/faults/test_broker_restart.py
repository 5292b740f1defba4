"""Scenario 2: the Kafka broker is killed and restarted while admission is under load.

On a private broker and Redis (``spendgate.devstack.LocalStack`` on free ports): while
Kafka is down admission keeps deciding from Redis and buffers its events; once the
bounded publish buffer is full, ``closed`` policies answer 503 and ``open`` ones admit.
After the restart every buffered event reaches the topic and the worker counts each
admitted reservation exactly once.

Expectations come from what the test sent and was told: admits are sent one at a time, so
with the buffer empty when Kafka dies (waited for) the first ``BUFFER`` admits while it is
down are buffered, after which closed answers 503 and open admits without an event. The
reservations that must be counted are exactly the 200 answers minus those open overflows.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis

from spendgate.devstack import LocalStack, StackSettings
from spendgate.schemas.events import parse_event
from spendgate.schemas.redis_keys import unpublished_reserves_key
from spendgate.streams.policy_admin import publish_policies
from spendgate.streams.settings import WorkerSettings
from tests.faults.conftest import AdmissionProcs, FaultRecord, read_buckets, read_topic
from tests.fixtures.admission import free_port
from tests.fixtures.consumption import wait_consumed
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, pending_sum
from tests.fixtures.pipeline import Workers, all_marked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
SCENARIO = 2
BUFFER = 12


def _dev(command: str, settings: StackSettings) -> None:
    """Run ``spendgate dev <command>`` for the private stack in a child process.

    ``LocalStack.up()`` in-process leaves its child ``Popen`` handles to the garbage
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


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    """A private Kafka broker and Redis on free ports, stopped (and discarded) afterwards."""
    settings = StackSettings(
        kafka_port=free_port(),
        kafka_controller_port=free_port(),
        redis_port=free_port(),
        stack_dir=tmp_path / "stack",
        cache_dir=Path.home() / ".cache" / "spendgate",
    )
    try:
        _dev("up", settings)
    except RuntimeError as exc:
        _dev("down", settings)
        pytest.fail(f"private Kafka/Redis did not start: {exc}")
    yield LocalStack(settings)
    _dev("down", settings)


@pytest.fixture
def stack_settings(stack: LocalStack, tmp_path: Path) -> WorkerSettings:
    s = stack.settings
    return WorkerSettings(
        kafka_bootstrap=f"127.0.0.1:{s.kafka_port}",
        redis_url=f"redis://127.0.0.1:{s.redis_port}/0",
        topic_prefix="f2.",
        redis_prefix="f2:",
        app_id="f2-app",
        data_dir=tmp_path / "tables",
        metrics_port=0,
        partitions=2,
        session_timeout_s=6.0,
    )


@pytest.fixture
def stack_workers(stack_settings: WorkerSettings, tmp_path: Path) -> Iterator[Workers]:
    factory = Workers(stack_settings, tmp_path)
    yield factory
    factory.stop_all()


def _buffer_depth(metrics: str) -> int | None:
    found = re.search(r"spendgate_admission_publish_buffer_events ([0-9.]+)", metrics)
    return int(float(found.group(1))) if found else None


async def _wait_drained(http: httpx.AsyncClient, what: str, timeout_s: float = 120) -> None:
    """Until admission's publish buffer is empty (every accepted event acked by Kafka)."""
    deadline = time.monotonic() + timeout_s
    while _buffer_depth((await http.get("/metrics")).text) != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"publish buffer not drained {what} within {timeout_s}s")
        await asyncio.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return not state.startswith("Z")  # a zombie is dead


def _overflow(metrics: str) -> int:
    found = re.search(
        r'spendgate_admission_publish_overflow_total\{action="admitted"\} ([0-9.]+)', metrics
    )
    return int(float(found.group(1))) if found else 0


class TestBrokerRestart:
    async def test_admission_buffers_through_a_broker_restart_and_counts_once(
        self,
        stack: LocalStack,
        stack_settings: WorkerSettings,
        stack_workers: Workers,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        fault_record: FaultRecord,
    ) -> None:
        settings = stack_settings
        client = redis.Redis.from_url(settings.redis_url)
        common = {"unit": "input_tokens", "limit": 10**9, "window": "1h", "bucket": "1m",
                  "group_by": ["tenant"]}  # fmt: skip
        closed = policy_factory(id="b-closed", failure="closed", match={"env": "c"}, **common)
        opened = policy_factory(id="b-open", failure="open", match={"env": "o"}, **common)
        stack_workers.start()
        await publish_policies(settings, [closed, opened])
        await eventually(
            lambda: (
                client.hlen(f"{settings.redis_prefix}policies") == 2
                and all_marked(client, settings.redis_prefix)
            ),
            what="policies materialized, every partition vouched for",
        )
        proc = admission_procs.start(
            kafka_bootstrap=settings.kafka_bootstrap,
            redis_url=settings.redis_url,
            topic_prefix=settings.topic_prefix,
            redis_prefix=settings.redis_prefix,
            # A short grace: the reserves that overflowed the buffer while Kafka was down are
            # republished from Redis by the sweeper soon after the broker is back.
            extra_env={
                "SPENDGATE_PUBLISH_BUFFER": str(BUFFER),
                "SPENDGATE_RESERVE_GRACE_S": "5",
                "SPENDGATE_RESERVE_SWEEP_S": "1",
            },
        )
        admitted: dict[str, int] = {}  # reservation id -> estimate
        env_of: dict[str, str] = {}
        order: list[tuple[str, str, str]] = []  # (phase, env, rid or "") in sending order
        answers: dict[str, Counter[str]] = {"before": Counter(), "down": Counter(),
                                             "after": Counter()}  # fmt: skip

        async def admit(http: httpx.AsyncClient, env: str, amount: int, phase: str) -> None:
            answer = await http.post("/v1/admit", json={
                "request_id": uuid.uuid4().hex,
                "subject": {"tenant": "acme", "model": "m", "env": env},
                "estimate": {"input_tokens": amount}})  # fmt: skip
            answers[phase][f"{env} {answer.status_code}"] += 1
            rid = ""
            if answer.status_code == 200:
                rid = answer.json()["reservation_id"]
                admitted[rid] = amount
                env_of[rid] = env
            order.append((phase, env, rid))

        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            for i in range(6):
                await admit(http, "co"[i % 2], 10 + i, "before")
            # Precondition: the buffer is empty, so the down phase starts from 0 of BUFFER.
            await _wait_drained(http, "before the kill")
            kafka_pid = stack.pid("kafka")
            assert kafka_pid is not None
            os.kill(kafka_pid, signal.SIGKILL)
            await eventually(lambda: not _alive(kafka_pid), timeout_s=30, what="Kafka gone")
            fault_record.fault("Kafka broker SIGKILLed (own LocalStack, free ports)")
            for i in range(40):
                await admit(http, "co"[i % 2], 100 + i, "down")
            metrics_down = (await http.get("/metrics")).text
            # What Redis lists as unpublished while Kafka is still down (reservation ids).
            listed = client.zrange(unpublished_reserves_key(settings.redis_prefix), 0, -1)
            unpub_down = {m.decode() for m in cast("list[bytes]", listed)}
            fault_record.fault(f"40 admits (closed and open alternately) while Kafka was down; "
                               f"publish buffer {BUFFER} events")  # fmt: skip
            started = time.monotonic()
            _dev("up", stack.settings)
            fault_record.fault(f"Kafka restarted ({time.monotonic() - started:.1f} s to ready)")
            await _wait_drained(http, "after the restart")  # the buffered events are acked
            for i in range(6):
                await admit(http, "co"[i % 2], 1000 + i, "after")
            await _wait_drained(http, "after the last admits")
            overflow = _overflow((await http.get("/metrics")).text)
        usage_topic = settings.topic("usage")
        # From the sending order alone: while down, the first BUFFER admitted requests take
        # the buffer's slots; open admits after that are admitted without an event.
        published: set[str] = set()
        unpublished: set[str] = set()
        slots = BUFFER
        for phase, _env, rid in order:
            if not rid:
                continue
            if phase != "down":
                published.add(rid)
            elif slots:
                slots -= 1
                published.add(rid)
            else:
                unpublished.add(rid)
        # Every admitted reservation reaches the log: through the buffer, or (the ones past
        # it) republished from Redis by the sweeper once Kafka is back.
        expected = {"b-closed": 0, "b-open": 0}
        for rid in admitted:
            expected["b-closed" if env_of[rid] == "c" else "b-open"] += admitted[rid]
        expected_pending = {"b-closed": 0, "b-open": 0}
        raws = await read_topic(settings.kafka_bootstrap, usage_topic, len(admitted), 90)
        # Everything on the topic read and acknowledged by the worker, then the windows.
        await wait_consumed(settings.kafka_bootstrap, settings.app_id, usage_topic, 180)
        raws = await read_topic(settings.kafka_bootstrap, usage_topic, len(admitted), 30)
        first_copy: dict[str, bytes] = {}
        ids: list[str] = []
        changed_copies = 0
        for raw in raws:
            event = parse_event(raw)
            if event.kind == "reserve":
                ids.append(event.reservation_id)
                if first_copy.setdefault(event.event_id, raw) != raw:
                    changed_copies += 1
        on_topic = set(ids)
        copies = Counter(ids)
        down_ids = {rid for phase, _env, rid in order if phase == "down" and rid}

        def counted() -> dict[str, int]:
            return {p: sum(read_buckets(client, settings.redis_prefix, f"{p}|tenant=acme")
                           .values()) for p in expected}  # fmt: skip

        unpub = unpublished_reserves_key(settings.redis_prefix)
        try:
            await eventually(lambda: counted() == expected, timeout_s=60,
                             what="every admitted reservation counted once")  # fmt: skip
            await eventually(lambda: client.zcard(unpub) == 0, timeout_s=30,
                             what="every acked reserve unlisted")  # fmt: skip
        finally:
            got = counted()
            unpublished_left = client.zcard(unpub)
            fault_record.add(
                events_checked=len(ids),
                answers={k: dict(v) for k, v in answers.items()},
                admitted_reservations=len(admitted),
                publish_overflow_admitted=overflow,
                buffer_depth_while_down=_buffer_depth(metrics_down),
                reserve_events_on_topic=len(ids),
                distinct_reserve_events_on_topic=len(on_topic),
                duplicate_records_on_topic=len(ids) - len(on_topic),
                overflowed_listed_unpublished_while_down=len(unpublished & unpub_down),
                overflowed_not_exactly_once_on_topic=sum(copies[r] != 1 for r in unpublished),
                unpublished_left=unpublished_left,
                duplicates_differing_from_first_copy=changed_copies,
                admitted_but_never_published=len(set(admitted) - on_topic),
                units_expected=expected,
                units_counted=got,
                units_lost=sum(max(0, expected[p] - got[p]) for p in expected),
                units_double_counted=sum(max(0, got[p] - expected[p]) for p in expected),
                pending_left={p: pending_sum(client, settings.redis_prefix, f"{p}|tenant=acme")
                              for p in expected},
            )  # fmt: skip
        # Budgets of 10**9: nothing is over a limit, so every answer is about the buffer.
        assert answers["before"] == Counter({"c 200": 3, "o 200": 3})
        # Admission keeps deciding from Redis: alternating c/o, the first BUFFER admits fill
        # the buffer (half of them closed); then closed refuses (503) and open admits.
        assert answers["down"] == Counter(
            {"c 200": BUFFER // 2, "o 200": 20, "c 503": 20 - BUFFER // 2}
        )
        # Kafka is back and the buffer drained: everything is admitted and published.
        assert answers["after"] == Counter({"c 200": 3, "o 200": 3})
        assert _buffer_depth(metrics_down) == BUFFER  # full, and never more than its bound
        # The product's overflow counter agrees with what the test derived.
        assert overflow == len(unpublished) == 20 - BUFFER // 2
        # The overflowed admits had no event in the buffer: while Kafka was down each was
        # listed in Redis's unpublished reserves (so is every admit of the down phase, none
        # acked yet), and the sweeper put each on the topic exactly once after the restart.
        assert len(unpublished) == 20 - BUFFER // 2
        assert down_ids <= unpub_down
        assert {r: copies[r] for r in unpublished} == dict.fromkeys(unpublished, 1)
        # Every admitted reservation reached the log; a reserve is on the topic more than
        # once only if it had two ways there (buffered while down, and listed for the
        # sweeper): every other reserve is one record.
        assert on_topic == set(admitted)
        assert len(ids) == len(on_topic) + sum(copies[r] - 1 for r in down_ids - unpublished)
        # Once every reserve is acked, none is listed as unpublished any more.
        assert unpublished_left == 0
        # A re-sent event (an ack lost in the restart, or a republished reserve) is the same
        # record, counted once.
        assert changed_copies == 0
        assert got == expected
        # Every reserve was absorbed by the worker: nothing left pending.
        assert {p: pending_sum(client, settings.redis_prefix, f"{p}|tenant=acme")
                for p in expected} == expected_pending  # fmt: skip
