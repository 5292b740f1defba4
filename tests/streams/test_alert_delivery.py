"""Alerts are at least once (issue 40): a send that failed is sent again, once, later."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from spendgate.schemas.alerts import Alert
from spendgate.streams.ledger import KeyState
from tests.streams.test_commit import BATCH, MemoryOutbox, Recorder, Rig, event


class AlertOutbox(MemoryOutbox):
    """The producer, whose next ``fail_alerts`` alert sends are never acked."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__(rec)
        self.fail_alerts = 0
        self.acked: list[str] = []

    async def alert(self, alert: Alert) -> Awaitable[Any]:
        self.rec.log.append(("send", "alert", alert.key))
        failing = self.fail_alerts > 0
        self.fail_alerts -= failing

        async def ack() -> None:
            await asyncio.sleep(0)
            if failing:
                raise ConnectionError(f"no ack for alert {alert.alert_id}")
            self.acked.append(alert.alert_id)

        return ack()


def _rig() -> tuple[Rig, AlertOutbox]:
    rig = Rig()
    outbox = AlertOutbox(rig.rec)
    rig.outbox = rig.commit.outbox = outbox
    return rig, outbox


class TestAlertsAtLeastOnce:
    async def test_an_alert_whose_send_failed_is_sent_once_with_the_next_batch(self) -> None:
        rig, outbox = _rig()
        outbox.fail_alerts = 1
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)  # 610 of 1,000 on acme: the 50% alert, never acked
        assert outbox.acked == [] and not rig.rec.of("offsets")
        # The batch again (its records now redeliveries: they raise no alert), then one
        # more batch: the alert goes out once, and not again after its ack.
        await rig.commit.run(BATCH)
        await rig.commit.run([event(1, 8, "bolt")])
        assert len(outbox.acked) == 1
        assert [s for s in rig.rec.of("send") if s[1] == "alert"] == [
            ("send", "alert", "ten|tenant=acme"),
            ("send", "alert", "ten|tenant=acme"),
        ]
        assert rig.commit.unsent == {}

    async def test_an_alert_of_a_batch_whose_redis_step_failed_is_sent_once(self) -> None:
        rig, outbox = _rig()
        rig.redis.fail = ConnectionError("Redis is gone")
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)
        rig.redis.fail = None
        await rig.commit.run(BATCH)  # the retry: redeliveries, the kept alert sent
        await rig.commit.run([event(1, 8, "bolt")])
        assert len(outbox.acked) == 1
        assert rig.commit.unsent == {}

    async def test_an_alert_unsent_when_the_process_died_is_sent_by_the_next_one(
        self,
    ) -> None:
        rig, outbox = _rig()
        outbox.fail_alerts = 1
        with pytest.raises(ConnectionError):
            await rig.commit.run(BATCH)  # the 50% alert raised, never acked
        # The process dies here. Its table is restored (same values: the changelog), the
        # batch is folded again (its records: redeliveries, no alert) by a new commit with
        # nothing in memory; then the partition's next batch sends the kept alert once.
        table = rig.table
        rig, outbox = _rig()
        rig.table = rig.commit.table = table
        rig.fold.states = {
            k: KeyState.from_bytes(v) for k, v in table.values.items() if not k.startswith("~")
        }
        await rig.commit.run(BATCH)
        await rig.commit.run([event(0, 9, "acme")])
        assert len(outbox.acked) == 1
        assert [s for s in rig.rec.of("send") if s[1] == "alert"] == [
            ("send", "alert", "ten|tenant=acme")
        ]
        # Acked: kept no more.
        assert not any(table.unsent([e]) for e in BATCH)
