"""Scenario 1: the worker is SIGKILLed mid-stream twice, at two different moments.

The windows after the last restart must equal the exact ledger of the randomized
workload bucket for bucket: no unit lost, no unit counted twice.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis

from streams.settings import WorkerSettings
from tests.faults.conftest import FaultRecord, compare
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, produce
from tests.fixtures.pipeline import ApplyPolicies, Workers
from tests.fixtures.workload import generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
SCENARIO = 1
EVENTS = 6000


async def _wait_progress(
    client: redis.Redis, prefix: str, expected: dict[str, dict[int, int]], above: int
) -> int:
    """Poll until more than ``above`` units of the ledger are materialized; return them."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        c = compare(client, prefix, expected)
        have = c.units_expected - c.units_lost + c.units_double_counted
        if have > above:
            return have
        await asyncio.sleep(0.05)
    raise AssertionError(f"no progress beyond {above} units in 120 s")


class TestWorkerCrash:
    async def test_two_sigkills_at_different_moments_lose_nothing_and_count_nothing_twice(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens", limit=10**12, window="1h", bucket="1m", group_by=["tenant"]
        )
        work = generate(policy, EVENTS, now_ms=int(time.time() * 1000), seed=101)
        prefix = worker_settings.redis_prefix
        half = len(work.records) // 2
        fault_record.add(
            records_produced=len(work.records),
            duplicate_records_in_workload=work.duplicates,
            ancient_records_in_workload=work.ancient,
            budget_keys=len(work.expected),
            ledger_units=sum(sum(b.values()) for b in work.expected.values()),
        )

        first = workers.start("first")
        await apply_policies(policy)
        await produce(worker_settings.kafka_bootstrap, worker_settings.topic("usage"),
                      work.records[:half])  # fmt: skip
        # Moment 1: as soon as the first counts reach Redis, in the middle of the first half.
        seen = await _wait_progress(redis_sync, prefix, work.expected, 0)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        at_kill = compare(redis_sync, prefix, work.expected)
        fault_record.fault(
            f"SIGKILL worker #1 after {seen} of {at_kill.units_expected} units were in Redis "
            "(first half of the records produced, processing under way)"
        )
        fault_record.add(kill1_units_materialized=seen)

        second = workers.start("second")
        # Moment 2: the second half is produced while the restarted worker recovers its
        # table from the changelog and re-reads uncommitted offsets; kill it once it has
        # moved past what the first worker left.
        await produce(worker_settings.kafka_bootstrap, worker_settings.topic("usage"),
                      work.records[half:])  # fmt: skip
        ledger_units = at_kill.units_expected
        seen2 = await _wait_progress(
            redis_sync, prefix, work.expected, max(seen, ledger_units // 2)
        )
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=30)
        at_kill2 = compare(redis_sync, prefix, work.expected)
        fault_record.fault(
            f"SIGKILL worker #2 (the restart) after {seen2} of {ledger_units} units were in "
            "Redis (past half of the ledger, both halves produced, catching up)"
        )
        fault_record.add(
            kill2_units_materialized=seen2,
            complete_before_third_start=at_kill2.exact,
        )

        workers.start("third")
        try:
            await eventually(
                lambda: compare(redis_sync, prefix, work.expected).exact,
                timeout_s=240,
                what="windows equal to the ledger after two SIGKILLs",
            )
        finally:
            final = compare(redis_sync, prefix, work.expected)
            fault_record.add(
                events_checked=len(work.records),
                cells_checked=final.cells,
                units_lost=final.units_lost,
                units_double_counted=final.units_double_counted,
                cells_differing=final.cells_differing,
            )
        assert not at_kill.exact, "killed too late to prove anything"
        assert final.exact
