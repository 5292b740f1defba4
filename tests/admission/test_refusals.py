"""The refusals buffer: bounded, never blocking, drops counted."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import REGISTRY

from spendgate.admission.refusals import KafkaRefusals
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.refusals import Refusal


def _dropped() -> float:
    return (
        REGISTRY.get_sample_value("spendgate_admission_refusals_total", {"result": "dropped"})
        or 0.0
    )


def _refusal(n: int) -> Refusal:
    return Refusal(
        request_id=f"r{n}",
        subject=Subject(tenant="acme"),
        estimate=Usage(input_tokens=1),
        violated=["p"],
        at=datetime(2026, 1, 1, tzinfo=UTC),
    )


class TestKafkaRefusals:
    def test_a_full_buffer_drops_and_counts_without_blocking(self) -> None:
        sink = KafkaRefusals(KafkaConnection(bootstrap="127.0.0.1:1"), "never.refusals", buffer=3)
        before = _dropped()
        taken = [sink.offer(_refusal(n)) for n in range(5)]
        assert taken == [True, True, True, False, False]
        assert sink.depth == 3
        assert _dropped() - before == 2

    def test_the_record_round_trips_as_json(self) -> None:
        refusal = _refusal(1)
        assert Refusal.model_validate_json(refusal.model_dump_json()) == refusal
