"""Scenario 1: the worker is SIGKILLed mid-stream twice, at two different moments.

The windows after the last restart must equal the exact ledger of the randomized
workload bucket for bucket: no unit lost, no unit counted twice. Both kills must land
mid-stream, measured against what had been produced when they landed: the windows then
hold part, but not all, of what the produced records add (``Workload.expected_after``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
import redis

from spendgate.streams.settings import WorkerSettings
from tests.faults.conftest import FaultRecord, compare
from tests.fixtures.consumption import wait_consumed
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
        have = compare(client, prefix, expected).units_held
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
        work = generate(policy, EVENTS, now_ms=int(time.time() * 1000), seed="worker-crash")
        prefix = worker_settings.redis_prefix
        half = len(work.records) // 2
        # Preconditions, counted from the records themselves: the workload holds re-sent
        # records (an event id seen before) and records older than the window.
        bodies = {body["event_id"]: body for body in (json.loads(v) for _, v in work.records)}
        resent = len(work.records) - len(bodies)
        cutoff = datetime.now(UTC) - timedelta(milliseconds=policy.window_ms)
        ancient = sum(datetime.fromisoformat(b["occurred_at"]) < cutoff for b in bodies.values())
        assert resent == work.duplicates > 0 and ancient == work.ancient > 0
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
        # Against what was produced so far (the first half), not the whole ledger.
        produced1 = compare(redis_sync, prefix, work.expected_after(half))
        fault_record.fault(
            f"SIGKILL worker #1 after {seen} of {produced1.units_expected} units produced so "
            "far were in Redis (first half of the records produced, processing under way)"
        )
        fault_record.add(
            kill1_units_materialized=seen,
            kill1_units_produced=produced1.units_expected,
            kill1_mid_stream=not produced1.exact,
        )
        assert seen > 0 and not produced1.exact, "kill 1 did not land mid-stream"

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
        # Everything is produced now: the whole ledger is what was produced so far.
        at_kill2 = compare(redis_sync, prefix, work.expected)
        fault_record.fault(
            f"SIGKILL worker #2 (the restart) after {seen2} of {ledger_units} units were in "
            "Redis (past half of the ledger, both halves produced, catching up)"
        )
        fault_record.add(
            kill2_units_materialized=seen2,
            complete_before_third_start=at_kill2.exact,
        )
        assert seen2 > seen and not at_kill2.exact, "kill 2 did not land mid-stream"

        workers.start("third")
        try:
            # Every usage record read and acknowledged by the worker's group, then the
            # windows: exact (nothing lost, nothing twice) and still exact a moment later.
            # The internal repartition topic's committed offsets are not waited on (faust
            # can leave them behind after a kill; see wait_consumed): the exact windows
            # prove its records were applied.
            await wait_consumed(
                worker_settings.kafka_bootstrap,
                worker_settings.app_id,
                worker_settings.topic("usage"),
                timeout_s=300,
                source_only=True,
            )
            await eventually(
                lambda: compare(redis_sync, prefix, work.expected).exact,
                timeout_s=120,
                what="windows equal to the ledger after two SIGKILLs",
            )
            await asyncio.sleep(2)
            assert compare(redis_sync, prefix, work.expected).exact
        finally:
            final = compare(redis_sync, prefix, work.expected)
            fault_record.add(
                events_checked=len(work.records),
                cells_checked=final.cells,
                units_lost=final.units_lost,
                units_double_counted=final.units_double_counted,
                cells_differing=final.cells_differing,
            )
        assert (final.units_lost, final.units_double_counted, final.cells_differing) == (0, 0, 0)
        # What Redis holds, every window under the prefix: the ledger's sum, on its keys.
        assert final.cells > 0 and final.units_held == work.units()
        assert final.keys_missing == final.keys_unexpected == ()

    async def test_a_wiped_table_folder_is_rebuilt_from_the_changelog(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        """The restarted worker's table comes back from its changelog topic, not from the
        usage topic (its offsets are committed) nor from Redis: every key touched after the
        wipe is written from the rebuilt state, so a table that came back empty would
        overwrite those windows with the second half alone and lose the first."""
        policy = policy_factory(
            unit="input_tokens", limit=10**12, window="1h", bucket="1m", group_by=["tenant"]
        )
        work = generate(policy, 1200, now_ms=int(time.time() * 1000), seed="changelog", tenants=8)
        half = len(work.records) // 2
        prefix, bootstrap = worker_settings.redis_prefix, worker_settings.kafka_bootstrap
        usage, group = worker_settings.topic("usage"), worker_settings.app_id
        workers.start("first")
        await apply_policies(policy)
        await produce(bootstrap, usage, work.records[:half])
        await wait_consumed(bootstrap, group, usage, timeout_s=180)
        first_half = work.expected_after(half)
        await eventually(
            lambda: compare(redis_sync, prefix, first_half).exact,
            timeout_s=60,
            what="first half counted",
        )
        workers.stop_all()
        shutil.rmtree(worker_settings.data_dir)
        fault_record.fault(
            f"worker stopped after {half} records; its table folder (SPENDGATE_DATA_DIR) deleted"
        )
        markers_before = set(redis_sync.scan_iter(match=f"{prefix}worker:*"))
        workers.start("second")
        # A starting worker finds no mark of its own and rewrites every window from its
        # table (streams/keeper.py RedisKeeper.run) from a snapshot taken before it awaits each
        # write; records applied meanwhile can be overwritten by that snapshot (a race
        # reported apart). Producing only once its mark is set keeps this test on its own
        # claim: the table itself came back from the changelog.
        await eventually(
            lambda: bool(set(redis_sync.scan_iter(match=f"{prefix}worker:*")) - markers_before),
            timeout_s=120,
            what="the restarted worker's start-up rewrite done (its mark set)",
        )
        await produce(bootstrap, usage, work.records[half:])
        fault_record.fault(f"worker restarted on an empty folder; {len(work.records) - half} more")
        try:
            # The whole ledger cannot be reached before every second-half record is applied;
            # then everything read, and the windows still exact (nothing applied twice late).
            await eventually(
                lambda: compare(redis_sync, prefix, work.expected).exact,
                timeout_s=240,
                what="windows equal to the ledger after the table was rebuilt",
            )
            await wait_consumed(bootstrap, group, usage, timeout_s=60)
        finally:
            final = compare(redis_sync, prefix, work.expected)
            touched_after = {k for effects in work.effects[half:] for k, _, _ in effects}
            fault_record.add(
                events_checked=len(work.records),
                keys_touched_after_the_wipe=len(touched_after),
                units_lost=final.units_lost,
                units_double_counted=final.units_double_counted,
                cells_differing=final.cells_differing,
            )
        # Precondition: the second half writes keys that held first-half usage.
        assert touched_after & {k for k, b in first_half.items() if b}
        assert (final.units_lost, final.units_double_counted, final.cells_differing) == (0, 0, 0)
        assert final.units_held == work.units()
        assert final.keys_missing == final.keys_unexpected == ()
