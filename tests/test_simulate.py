"""simulate's judge: all matching draft policies at once, all-or-nothing, cap, observe."""

from __future__ import annotations

from admission.decide import Planner
from schemas.events import Subject, Usage
from schemas.policies import Policy
from spendgate.simulate import judge, unsupported


def policy(pid: str, **fields: object) -> Policy:
    return Policy.model_validate({"id": pid, "unit": "output_tokens", "limit": 100, **fields})


def charges(*policies: Policy, output: int = 50) -> list:  # type: ignore[type-arg]
    return Planner(list(policies), None).charges(
        Subject(tenant="a", model="m"), Usage(requests=1, input_tokens=10, output_tokens=output)
    )


class TestJudge:
    def test_fits_everywhere_admits_with_the_asked_amounts(self) -> None:
        got = judge(charges(policy("a"), policy("b")), [10, 20], 50)
        assert not got.refused and got.amounts == (50, 50) and got.max_output_tokens is None

    def test_one_enforced_policy_over_refuses_the_whole_request(self) -> None:
        got = judge(charges(policy("a"), policy("b")), [10, 60], 50)
        assert got.refused and got.violated == ("b",)

    def test_observe_never_refuses(self) -> None:
        got = judge(charges(policy("a", mode="observe")), [90], 50)
        assert not got.refused

    def test_cap_admits_with_the_output_that_fits_every_key(self) -> None:
        got = judge(charges(policy("a", on_exceed="cap"), policy("b", limit=1000)), [70, 0], 50)
        assert not got.refused and got.max_output_tokens == 30 and got.amounts == (30, 30)

    def test_cap_cannot_help_a_unit_that_ignores_output(self) -> None:
        got = judge(charges(policy("a", on_exceed="cap", unit="requests", limit=1)), [1], 50)
        assert got.refused


class TestUnsupported:
    def test_delay_route_and_downgrade_drafts_are_named(self) -> None:
        drafts = [
            policy("d", on_exceed="delay"),
            policy("r", on_exceed="route", route_to="west"),
            policy("ok"),
        ]
        assert [m.split(":")[0] for m in unsupported(drafts)] == ["d", "r"]
