"""The worker never hangs (issue 52): a stall is seen, the process replaced, SIGTERM honoured.

Real ``spendgate worker`` processes on the real Kafka and Redis, started through
``tests.fixtures.hung_worker`` so that a test can switch a stall on at a moment of its
choosing: produce requests that reach no broker and are never answered (what the worker met
on the three-broker SASL_SSL stack: its ``split`` agent waiting for acks for ever), or an
event loop blocked in ``time.sleep`` by a test agent. Small bounds keep the tests short:

- a hung send: ``/healthz`` answers 503 within the stall bound, the batch is committed
  again past the Kafka wait bound (counted), the diagnostics name the partition waiting
  for acks, and the process exits 4 at the exit bound; a new worker then finishes the
  work with every window equal to what was produced (nothing lost, nothing doubled);
- SIGTERM during a hung send: the process exits within its stop grace, and a new worker
  finishes the work the same way;
- a blocked loop: ``/healthz`` answers 503 while it lasts and 200 again after; a block
  past the exit bound ends the process (the watchdog is a thread); an idle worker stays
  healthy past every bound.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis

from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, metric, produce, window_sum
from tests.fixtures.pipeline import ApplyPolicies, Workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TENANTS = ["a", "b", "c"]
#: The bounds the stalled workers run with (the defaults are 30, 45, 120 and 10 s).
KAFKA_WAIT_S, STALL_S, EXIT_S, GRACE_S = 1.5, 3.0, 8.0, 3.0
#: How late a probe or an exit may come after its bound on a loaded 2-core box.
SLACK_S = 2.5
HUNG = "tests.fixtures.hung_worker"


def _commit(tenant: str, amount: int) -> bytes:
    return json.dumps(
        {
            "event_id": uuid.uuid4().hex,
            "kind": "commit",
            "subject": {"tenant": tenant, "model": "m"},
            "occurred_at": datetime.now(UTC).isoformat(),
            "usage": {"input_tokens": amount},
        }
    ).encode()


class Usage:
    """Commits produced straight to ``usage``, with their exact totals."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.sent: Counter[str] = Counter()

    async def send(self, n: int) -> None:
        batch = []
        for i in range(n):
            tenant = TENANTS[i % len(TENANTS)]
            amount = 1 + i % 5
            self.sent[tenant] += amount
            batch.append((tenant.encode(), _commit(tenant, amount)))
        await produce(self.settings.kafka_bootstrap, self.settings.topic("usage"), batch)

    def counted(self, client: redis.Redis) -> bool:
        prefix = self.settings.redis_prefix
        return window_sum(client, prefix, "overall") == sum(self.sent.values()) and all(
            window_sum(client, prefix, f"per-tenant|tenant={t}") == self.sent[t] for t in TENANTS
        )


def _healthz(port: int) -> tuple[int, dict[str, object]] | None:
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
        return answer.status_code, answer.json()
    except (httpx.HTTPError, ValueError):
        return None


async def _until_unhealthy(port: int, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = _healthz(port)
        if got is not None and got[0] == 503:
            return got[1]
        await asyncio.sleep(0.1)
    raise AssertionError(f"/healthz did not answer 503 within {timeout_s} s: {_healthz(port)}")


async def _exited(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"the worker still runs after {timeout_s} s"
        await asyncio.sleep(0.1)
    return proc.returncode


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    return {
        "SPENDGATE_WORKER_KAFKA_WAIT_S": str(KAFKA_WAIT_S),
        "SPENDGATE_WORKER_STALL_S": str(STALL_S),
        "SPENDGATE_WORKER_EXIT_S": str(EXIT_S),
        "SPENDGATE_WORKER_STOP_GRACE_S": str(GRACE_S),
        "SPENDGATE_TEST_HANG_FILE": str(tmp_path / "hang"),
        "SPENDGATE_TEST_BLOCK_FILE": str(tmp_path / "block"),
        **more,
    }


async def _policies(apply_policies: ApplyPolicies, policy_factory: PolicyFactory) -> None:
    per_tenant = policy_factory(
        id="per-tenant", unit="input_tokens", limit=10**9, window="1h", bucket="1m"
    )
    # Spanning tenants: its records cross the keyed topic, whose sends the batch awaits.
    overall = policy_factory(
        id="overall", unit="input_tokens", limit=10**9, window="1h", bucket="1m", group_by=[]
    )
    await apply_policies(per_tenant, overall)


async def _counting(
    worker_settings: WorkerSettings,
    apply_policies: ApplyPolicies,
    policy_factory: PolicyFactory,
    redis_sync: redis.Redis,
    first: int,
) -> Usage:
    """The policies applied and ``first`` commits counted by the worker just started."""
    usage = Usage(worker_settings)
    await _policies(apply_policies, policy_factory)
    await usage.send(first)
    await eventually(lambda: usage.counted(redis_sync), 60, "the first commits counted")
    return usage


async def _finished_by_a_new_worker(
    workers: Workers, usage: Usage, redis_sync: redis.Redis, tmp_path: Path
) -> None:
    """Its supervisor starts it again (no stall this time): nothing lost, nothing doubled."""
    (tmp_path / "hang").unlink()
    again = workers.start("w2", metrics_port=free_port())
    await eventually(lambda: usage.counted(redis_sync), 90, "every commit counted once")
    assert again.poll() is None


class TestHungSend:
    async def test_healthz_fails_the_batch_is_sent_again_then_the_worker_exits_4(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        tmp_path: Path,
    ) -> None:
        port = free_port()
        keyed = worker_settings.keyed_topic
        proc = workers.start(
            metrics_port=port, env=_env(tmp_path, SPENDGATE_TEST_HANG_TOPICS=keyed), module=HUNG
        )
        usage = await _counting(
            worker_settings, apply_policies, policy_factory, redis_sync, first=30
        )
        assert _healthz(port) == (200, {"status": "ok"})

        (tmp_path / "hang").touch()
        hung = time.monotonic()
        await usage.send(30)
        body = await _until_unhealthy(port, STALL_S + KAFKA_WAIT_S + SLACK_S + 3)
        unhealthy_s = time.monotonic() - hung
        assert body["status"] == "stalled"
        assert "agent" in str(body["reason"]) or "offset commit" in str(body["reason"])
        assert metric(port, "spendgate_worker_bound_hits_total") >= 1
        assert metric(port, "spendgate_worker_resends_total") >= 1
        # The watchdog judges every 0.25 s; /healthz on each request.
        await eventually(lambda: metric(port, "spendgate_worker_stalled") == 1, 3, "stalled=1")
        code = await _exited(proc, EXIT_S + SLACK_S + 5)
        exited_s = time.monotonic() - hung
        print(
            f"hung send: /healthz 503 after {unhealthy_s:.1f} s, exit {code} after {exited_s:.1f} s"
        )
        assert code == 4
        log = (tmp_path / "worker-w1.log").read_text(errors="replace")
        assert "worker diagnostics" in log
        assert "aiokafka sender task: alive" in log
        assert f"waiting for acks: {keyed}[" in log
        assert "worker exits 4: no progress" in log

        await _finished_by_a_new_worker(workers, usage, redis_sync, tmp_path)

    async def test_sigterm_during_a_hung_send_exits_within_the_grace(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        tmp_path: Path,
    ) -> None:
        port = free_port()
        # The exit bound far away: only the stop's grace can end the process in time.
        env = _env(tmp_path, SPENDGATE_WORKER_EXIT_S="120")
        proc = workers.start(metrics_port=port, env=env, module=HUNG)
        usage = await _counting(
            worker_settings, apply_policies, policy_factory, redis_sync, first=30
        )

        (tmp_path / "hang").touch()
        await usage.send(30)
        await _until_unhealthy(port, STALL_S + KAFKA_WAIT_S + SLACK_S + 3)
        proc.terminate()
        asked = time.monotonic()
        code = await _exited(proc, GRACE_S + SLACK_S)
        stopped_s = time.monotonic() - asked
        print(f"SIGTERM during a hung send: exit {code} after {stopped_s:.1f} s")
        assert code == 4
        assert stopped_s >= GRACE_S - 0.5
        log = (tmp_path / "worker-w1.log").read_text(errors="replace")
        assert "the stop asked" in log and "has not finished" in log

        await _finished_by_a_new_worker(workers, usage, redis_sync, tmp_path)


class TestBlockedLoop:
    async def test_healthz_fails_while_the_loop_is_blocked_and_the_worker_exits_past_the_bound(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        tmp_path: Path,
    ) -> None:
        port = free_port()
        proc = workers.start(metrics_port=port, env=_env(tmp_path), module=HUNG)
        await _counting(worker_settings, apply_policies, policy_factory, redis_sync, first=9)

        # Idle past every bound: healthy all along.
        idle = time.monotonic()
        while time.monotonic() - idle < EXIT_S + 1:
            assert _healthz(port) == (200, {"status": "ok"})
            await asyncio.sleep(0.5)
        assert proc.poll() is None

        # Blocked for longer than the stall bound, shorter than the exit bound.
        (tmp_path / "block").write_text(str(STALL_S + 3))
        body = await _until_unhealthy(port, STALL_S + SLACK_S + 1)
        assert "the event loop has not run" in str(body["reason"])
        await eventually(lambda: _healthz(port) == (200, {"status": "ok"}), 15, "healthy again")
        assert proc.poll() is None

        # Blocked past the exit bound: the watchdog thread ends the process.
        (tmp_path / "block").write_text(str(EXIT_S * 4))
        blocked = time.monotonic()
        code = await _exited(proc, EXIT_S + SLACK_S + 2)
        print(f"blocked loop: exit {code} after {time.monotonic() - blocked:.1f} s")
        assert code == 4
