"""Which refusals a ``delay`` policy may hold (pure, no services)."""

from __future__ import annotations

from typing import Any

from spendgate.admission.decide import AdmitResult, Charge, KeyState, Plan, PolicyTerms
from spendgate.admission.delay import delay_of, waitable_ms
from spendgate.schemas.events import Subject
from spendgate.schemas.matching import BudgetTarget
from spendgate.schemas.policies import Policy


def _charge(pid: str, **fields: Any) -> Charge:
    policy = Policy.model_validate({"id": pid, "unit": "requests", "limit": 10, **fields})
    return Charge(BudgetTarget(policy, pid), 1, terms=PolicyTerms.of(policy))


def _result(violated: list[bool], retry_ms: int | None = 2000, **fields: Any) -> AdmitResult:
    keys = tuple(KeyState(0, 0, 0, v, 0) for v in violated)
    base: dict[str, Any] = {
        "replayed": False,
        "outcome": "reject",
        "now_ms": 0,
        "retry_after_ms": retry_ms,
        "never_fits": False,
        "reservation_id": "r",
        "plan": 0,
        "max_output_tokens": None,
        "keys": keys,
    }
    return AdmitResult(**{**base, **fields})


PLAN = Plan(
    Subject(tenant="t"),
    (
        _charge("a", on_exceed="delay", max_delay="3s"),
        _charge("b", on_exceed="delay"),
        _charge("c"),
        _charge("d", on_exceed="delay", mode="observe"),
    ),
)


class TestWaitable:
    def test_the_delaying_keys(self) -> None:
        assert delay_of(PLAN) == ("a", "b")

    def test_the_smallest_max_delay_among_the_refusing_keys(self) -> None:
        assert waitable_ms(PLAN, _result([True, True, False, False])) == 3000
        assert waitable_ms(PLAN, _result([False, True, False, False])) == 5000

    def test_a_refusing_key_that_does_not_delay_is_never_held(self) -> None:
        assert waitable_ms(PLAN, _result([True, False, True, False])) is None

    def test_an_observe_key_neither_holds_nor_blocks(self) -> None:
        assert waitable_ms(PLAN, _result([False, True, False, True])) == 5000

    def test_never_fits_and_non_refusals_are_not_held(self) -> None:
        assert waitable_ms(PLAN, _result([True, False, False, False], never_fits=True)) is None
        assert waitable_ms(PLAN, _result([True, False, False, False], None)) is None
        allowed = _result([False] * 4, outcome="allow")
        assert waitable_ms(PLAN, allowed) is None
