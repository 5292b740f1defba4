"""Scenario 13: a Redis window altered behind the worker's back is healed within one cycle.

Windows are written, then changed directly in Redis (amounts doubled in one, a bucket
removed from another, one deleted outright) while traffic goes on. The worker's drift
check must put back exactly what the test sent, within one drift cycle, count each healed
window, and never overwrite a newer window with an older one (the windows receiving new
events while the check runs end equal to everything sent).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis

from schemas import window_codec
from schemas.redis_keys import window_key
from streams.settings import WorkerSettings
from tests.faults.conftest import FaultRecord
from tests.fixtures.admission import free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import buckets, eventually, metric, produce, window_sum
from tests.fixtures.pipeline import ApplyPolicies, Workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SCENARIO = 13
TENANTS = [f"t{i}" for i in range(12)]
PER_TENANT = 40


def _commit(tenant: str, at: datetime, tokens: int) -> bytes:
    return json.dumps(
        {
            "event_id": uuid.uuid4().hex,
            "kind": "commit",
            "subject": {"tenant": tenant, "model": "m"},
            "occurred_at": at.isoformat(),
            "usage": {"input_tokens": tokens},
        }
    ).encode()


class TestDrift:
    async def test_altered_windows_are_healed_within_one_cycle_and_counted(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        port = free_port()
        # 4 keys per second: one cycle over the 12 keys takes 3 s.
        workers.start(metrics_port=port, env={"SPENDGATE_DRIFT_KEYS_PER_S": "4"})
        policy = policy_factory(unit="input_tokens", limit=10**9, window="1h", bucket="1m")
        await apply_policies(policy)
        prefix = worker_settings.redis_prefix
        now = datetime.now(UTC)
        sent = dict.fromkeys(TENANTS, 0)
        for t in TENANTS:
            values = []
            for i in range(PER_TENANT):
                tokens = 1 + (i * 7) % 50
                sent[t] += tokens
                values.append(_commit(t, now - timedelta(seconds=30 * i), tokens))
            await produce(
                worker_settings.kafka_bootstrap,
                worker_settings.topic("usage"),
                [(t.encode(), v) for v in values],
            )

        def key(t: str) -> str:
            return f"{policy.id}|tenant={t}"

        def sums() -> dict[str, int]:
            return {t: window_sum(redis_sync, prefix, key(t)) for t in TENANTS}

        await eventually(lambda: sums() == sent, timeout_s=120, what="every event counted")
        healed_before = metric(port, "spendgate_drift_keys_total")
        assert healed_before == 0, "nothing had drifted yet"

        # Behind the worker's back: double one window, drop a bucket of another, delete a
        # third. The altered keys stay quiet; others keep receiving events.
        doubled, trimmed, deleted = TENANTS[0], TENANTS[1], TENANTS[2]
        b = buckets(redis_sync, prefix, key(doubled))
        redis_sync.set(
            window_key(prefix, key(doubled)),
            window_codec.encode({s: 2 * a for s, a in b.items()}, 60_000),
        )
        b = buckets(redis_sync, prefix, key(trimmed))
        b.pop(max(b))
        redis_sync.set(window_key(prefix, key(trimmed)), window_codec.encode(b, 60_000))
        redis_sync.delete(window_key(prefix, key(deleted)))
        assert sums()[doubled] == 2 * sent[doubled] and sums()[trimmed] < sent[trimmed]
        busy = TENANTS[3:]
        for t in busy:
            await produce(
                worker_settings.kafka_bootstrap,
                worker_settings.topic("usage"),
                [(t.encode(), _commit(t, now, 5))],
            )
            sent[t] += 5
        # One cycle is 3 s; allow three cycles on a loaded box, plus the events in flight.
        await eventually(lambda: sums() == sent, timeout_s=15, what="altered windows healed")
        healed = metric(port, "spendgate_drift_keys_total") - healed_before
        cycle_s = metric(port, "spendgate_drift_last_cycle_seconds")
        fault_record.add(
            keys=len(TENANTS),
            windows_altered=3,
            windows_healed=int(healed),
            units_lost=sum(max(0, sent[t] - v) for t, v in sums().items()),
            units_double_counted=sum(max(0, v - sent[t]) for t, v in sums().items()),
            drift_cycle_seconds=cycle_s,
        )
        # Exactly the three altered windows were healed: the busy ones were never judged
        # stale against a newer write.
        assert healed == 3
        assert 0 < cycle_s < 10
