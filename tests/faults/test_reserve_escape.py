"""Scenario 12 (item 2): no reservation escapes when admission dies before its reserve
reaches Kafka.

A real admission process whose Kafka bootstrap is a closed port admits reservations (its
admit path never waits for Kafka, so every one is answered 200 and held in Redis) and is
killed (kill -9) with none of its reserve events published. Another process, on the good
broker, settles a third of them by commit and a third by release, and stops: their
settlements reach the topic *before* their reserves. A third process, on the good broker
with a short grace period, republishes every reserve from Redis. Checked against what the
test sent: every reserve lands on the topic exactly once, byte-equal in content to the
admission (reservation id, subject, estimate, admission instant), within the grace period
plus a bound; and the worker's own pure fold of the topic (``fan_out`` + ``apply``)
charges exactly the committed actuals plus the estimates of the open reservations, so a
reserve arriving after its own settlement charges nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import httpx
import pytest
import redis
from aiokafka import AIOKafkaConsumer

from spendgate.schemas.events import ReserveEvent, parse_event
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import unpublished_reserves_key
from spendgate.streams.dedupe import IdStore, Position
from spendgate.streams.kafka_util import assign, partitions, stop
from spendgate.streams.ledger import KeyState, apply
from tests.faults.conftest import AdmissionProcs, FaultRecord, write_policies
from tests.fixtures.admission import free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.fanout import fan_out
from tests.fixtures.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SCENARIO = 12
TENANT = "acme"
RESERVATIONS = 60
#: The sweeping process's grace period and sweep interval.
GRACE_S = 5.0
SWEEP_S = 0.5
#: Beyond the grace period: the sweep interval, publishing and acking, a loaded box.
BOUND_S = 25.0
#: A settler that must never sweep while it runs.
NEVER_S = "3600"


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


def _fold(records: list[tuple[bytes, Position]], policy: Policy) -> tuple[int, Counter[str]]:
    """The window total the worker's pure fold computes from the log, and its outcomes."""
    state, outcomes = KeyState(), Counter[str]()
    ids = IdStore(None, 86_400_000)
    try:
        for raw, pos in sorted(records, key=lambda r: (r[1].partition, r[1].offset)):
            out = fan_out(raw, broker_ms=pos.arrival_ms, policies=[policy], prices=None,
                          max_future_skew_ms=300_000, src=pos, ids=ids)  # fmt: skip
            ids.advance(pos)
            if out.duplicate:
                outcomes["duplicate"] += 1
            for rec in out.records:
                outcomes["settled_reserve" if rec.settled else rec.kind] += 1
                outcomes[apply(state, rec).outcome] += 1
    finally:
        ids.close()
    return sum(state.buckets.values()), outcomes


class TestReserveEscape:
    async def test_admission_killed_before_its_reserves_reach_kafka_loses_none(
        self,
        services: Services,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        key_prefix: str,
        topic_prefix: str,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(id="escape", unit="input_tokens", limit=10**12, window="1h",
                                bucket="1m", group_by=["tenant"], failure="closed")  # fmt: skip
        await write_policies(services.redis_url, key_prefix, policy)
        topic = f"{topic_prefix}usage"
        common = {"redis_url": services.redis_url, "topic_prefix": topic_prefix,
                  "redis_prefix": key_prefix}  # fmt: skip

        # 1. Admission with no reachable Kafka: admits answer 200 and publish nothing.
        dead = admission_procs.start(
            kafka_bootstrap=f"127.0.0.1:{free_port()}", name="no-kafka", **common,
            extra_env={"SPENDGATE_RESERVE_GRACE_S": NEVER_S},
        )  # fmt: skip
        estimate = {i: 1_000 + i for i in range(RESERVATIONS)}
        rids: dict[str, int] = {}
        before_ms = int(time.time() * 1000)
        async with httpx.AsyncClient(base_url=dead.url, timeout=30) as http:
            for i in range(RESERVATIONS):
                answer = await http.post("/v1/admit", json={
                    "request_id": uuid.uuid4().hex, "subject": {"tenant": TENANT, "model": "m"},
                    "estimate": {"input_tokens": estimate[i]}})  # fmt: skip
                assert answer.status_code == 200, answer.text
                rids[answer.json()["reservation_id"]] = i
        after_ms = int(time.time() * 1000)
        dead.proc.kill()
        dead.proc.wait()
        killed_at = time.monotonic()
        fault_record.fault(
            f"{RESERVATIONS} admits answered 200 by an admission process whose Kafka "
            "bootstrap is a closed port; it was killed (kill -9)"
        )
        listed = {
            m.decode() for m in redis_sync.zrange(unpublished_reserves_key(key_prefix), 0, -1)
        }
        assert listed == set(rids)
        assert not [v for v, _ in await _topic(services.kafka_bootstrap, topic)]

        # 2. Settled through another process before any reserve is on the topic.
        order = list(rids)
        commits = {r: 1 + rids[r] for r in order[: RESERVATIONS // 3]}
        releases = set(order[RESERVATIONS // 3 : 2 * RESERVATIONS // 3])
        still_open = set(order[2 * RESERVATIONS // 3 :])
        settler = admission_procs.start(
            kafka_bootstrap=services.kafka_bootstrap, name="settler", **common,
            extra_env={"SPENDGATE_RESERVE_GRACE_S": NEVER_S},
        )  # fmt: skip
        async with httpx.AsyncClient(base_url=settler.url, timeout=30) as http:
            for rid, actual in commits.items():
                answer = await http.post("/v1/commit", json={
                    "reservation_id": rid, "usage": {"input_tokens": actual}})  # fmt: skip
                assert answer.status_code == 202, answer.text
            for rid in releases:
                answer = await http.post("/v1/release", json={"reservation_id": rid})
                assert answer.status_code == 202, answer.text
        settler.proc.terminate()
        settler.proc.wait(timeout=30)
        fault_record.fault(f"{len(commits)} commits and {len(releases)} releases of those "
                           "reservations through another process (answered 202), before any "
                           "reserve was on the topic; that process stopped")  # fmt: skip

        # 3. A process on the good broker republishes what the dead one never published.
        sweeper = admission_procs.start(
            kafka_bootstrap=services.kafka_bootstrap, name="sweeper", **common,
            extra_env={"SPENDGATE_RESERVE_GRACE_S": str(GRACE_S),
                       "SPENDGATE_RESERVE_SWEEP_S": str(SWEEP_S)},
        )  # fmt: skip
        ready_at = time.monotonic()
        fault_record.fault(f"admission started on the good broker (grace {GRACE_S:.0f} s, "
                           f"sweep every {SWEEP_S} s)")  # fmt: skip
        want = {f"reserve-{r}" for r in rids}
        landed_at = None
        deadline = ready_at + GRACE_S + BOUND_S
        while time.monotonic() < deadline:
            on_topic = {parse_event(v).event_id for v, _ in await _topic(services.kafka_bootstrap,
                                                                          topic)}  # fmt: skip
            if want <= on_topic:
                landed_at = time.monotonic()
                break
            await asyncio.sleep(0.5)
        # Two more sweeps, so a late duplicate would show.
        await asyncio.sleep(2 * SWEEP_S + 1)
        records = await _topic(services.kafka_bootstrap, topic)
        events = [parse_event(v) for v, _ in records]
        counts = Counter(e.event_id for e in events)
        reserves = [e for e in events if isinstance(e, ReserveEvent)]
        position = {parse_event(v).event_id: pos for v, pos in records}
        after_settlement = sum(
            1 for r in set(commits) | releases
            if position[f"reserve-{r}"].offset > position[
                f"{'commit' if r in commits else 'release'}-{r}"].offset
        )  # fmt: skip
        total, outcomes = _fold(records, policy)
        expected_total = sum(commits.values()) + sum(estimate[rids[r]] for r in still_open)
        fault_record.add(
            events_checked=len(records),
            reservations=RESERVATIONS,
            reserves_on_topic_distinct=len({e.event_id for e in reserves}),
            reserves_missing=len(want - set(counts)),
            reserve_records_not_exactly_one=sum(counts[e] != 1 for e in want),
            duplicate_records_on_topic=sum(n - 1 for n in counts.values()),
            seconds_kill_to_all_reserves=(
                None if landed_at is None else round(landed_at - killed_at, 1)),
            seconds_ready_to_all_reserves=(
                None if landed_at is None else round(landed_at - ready_at, 1)),
            bound_seconds=GRACE_S + BOUND_S,
            reserves_after_their_settlement=after_settlement,
            fold_outcomes=dict(outcomes),
            window_total=total,
            window_total_expected=expected_total,
            units_lost=max(0, expected_total - total),
            units_double_counted=max(0, total - expected_total),
        )  # fmt: skip
        fault_record.inputs.append(f"sweeper log: {sweeper.log}")
        assert landed_at is not None, f"missing after {GRACE_S + BOUND_S} s: {want - set(counts)}"
        # Exactly once per event id: the dead process never reached the broker, the settler
        # never swept (grace of an hour), and the sweeper's claim holds for a grace period
        # while its publisher joins a copy it still holds instead of sending another.
        assert {e.event_id for e in reserves} == want
        assert all(counts[e] == 1 for e in counts), {e: n for e, n in counts.items() if n != 1}
        assert set(counts) == want | {f"commit-{r}" for r in commits} | {
            f"release-{r}" for r in releases}  # fmt: skip
        for event in reserves:  # what the test sent, at the instant it was admitted
            i = rids[event.reservation_id]
            assert event.subject.tenant == TENANT and event.subject.model == "m"
            assert event.usage.input_tokens == estimate[i]
            assert before_ms - 1_000 <= event.occurred_ms <= after_ms + 1_000
            assert event.expires_ms - event.occurred_ms == policy.reservation_ttl_ms
        # Settled before their reserves arrived: those reserves charge nothing.
        assert after_settlement == len(commits) + len(releases)
        # The fold, record by record, against what the test sent: no copy dropped (there
        # is none), each of the 100 events applied, the open reserves charging.
        assert sum(n - 1 for n in counts.values()) == 0
        assert outcomes == Counter({
            "applied": len(want) + len(commits) + len(releases), "commit": len(commits),
            "release": len(releases), "reserve": len(still_open),
            "settled_reserve": len(commits) + len(releases)})  # fmt: skip
        assert total == expected_total
        # Every acked reserve is unlisted (in batches, after the acks).
        for _ in range(40):
            if not redis_sync.zcard(unpublished_reserves_key(key_prefix)):
                break
            await asyncio.sleep(0.25)
        assert redis_sync.zcard(unpublished_reserves_key(key_prefix)) == 0
