"""Claims of README.md about input types, checked where they are decided (the models)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from spendgate.schemas.events import parse_event

_BASE: dict[str, Any] = {
    "schema_version": 1,
    "event_id": "e1",
    "kind": "commit",
    "occurred_at": "2026-01-01T00:00:00Z",
    "subject": {"tenant": "acme"},
}


def _commit(amount: Any) -> bytes:
    return json.dumps({**_BASE, "usage": {"input_tokens": amount}}).encode()


class TestAmountTypes:
    @pytest.mark.parametrize("amount", ["100", True, False, 1.5, None, [1]])
    def test_strings_booleans_and_fractions_are_refused(self, amount: Any) -> None:
        with pytest.raises(ValidationError, match="input_tokens"):
            parse_event(_commit(amount))

    def test_a_whole_float_counts_as_its_integer(self) -> None:
        # JSON Schema counts 5.0 an integer; the OpenAPI document and behaviour agree.
        event = parse_event(_commit(5.0))
        assert event.usage is not None and event.usage.input_tokens == 5

    def test_times_before_1970_are_refused(self) -> None:
        raw = json.dumps({**_BASE, "occurred_at": "1969-12-31T23:59:59Z",
                          "usage": {"input_tokens": 1}}).encode()  # fmt: skip
        with pytest.raises(ValidationError, match="occurred_at"):
            parse_event(raw)
