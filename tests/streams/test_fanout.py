"""The first stage: validation, dead-letter reasons, clamping, fan-out per policy."""

from __future__ import annotations

import json
from typing import Any

from spendgate.schemas.policies import Policy
from spendgate.streams.dedupe import Position
from tests.fixtures.fanout import fan_out

NOW_MS = 1_800_000_000_000
POLICIES = [
    Policy(id="tokens", unit="total_tokens", limit=1000, group_by=["tenant"]),
    Policy(id="cost", unit="cost_usd", limit=1000, match={"model": "m*"}),
]


def raw(**overrides: Any) -> bytes:
    event = {
        "event_id": "e1",
        "kind": "commit",
        "subject": {"tenant": "acme", "model": "m1"},
        "occurred_at": "2027-01-15T08:00:00Z",
        "usage": {"input_tokens": 5},
    }
    event.update(overrides)
    return json.dumps(event).encode()


def run(data: bytes, skew_ms: int = 300_000) -> Any:
    return fan_out(
        data,
        broker_ms=NOW_MS,
        policies=POLICIES,
        prices=None,
        max_future_skew_ms=skew_ms,
        src=Position(0, 0, NOW_MS),
    )


class TestFanOut:
    def test_garbage_is_rejected_with_a_reason(self) -> None:
        assert "invalid event" in (run(b"\x00not json").rejected or "")

    def test_a_bad_field_is_named(self) -> None:
        out = run(raw(usage={"input_tokens": -3}))
        assert out.rejected and "usage.input_tokens" in out.rejected

    def test_unknown_kind_is_rejected(self) -> None:
        assert run(raw(kind="refund")).rejected

    def test_one_unpriceable_policy_does_not_stop_the_others(self) -> None:
        out = run(raw())
        assert [r.policy for r in out.records] == ["tokens"]
        assert out.partial and "cost" in out.partial[0] and "m1" in out.partial[0]

    def test_a_missing_group_by_field_rejects_the_record(self) -> None:
        out = run(raw(subject={"model": "x"}))
        assert out.rejected and "tenant" in out.rejected

    def test_far_future_time_is_clamped_to_the_broker_time(self) -> None:
        out = run(
            raw(occurred_at="2099-01-01T00:00:00Z", usage={"input_tokens": 5, "cost_usd_micros": 1})
        )
        assert out.clamped
        assert {r.occurred_ms for r in out.records} == {NOW_MS}

    def test_time_within_the_skew_is_kept(self) -> None:
        out = run(raw(usage={"input_tokens": 5, "cost_usd_micros": 7}), skew_ms=10**13)
        assert not out.clamped
        assert {r.amount for r in out.records} == {5, 7}
