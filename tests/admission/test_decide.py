"""The pure decision module: plans, cap terms, script result -> answer, failure modes."""

from __future__ import annotations

from typing import Any

import pytest

from spendgate.admission.decide import (
    AdmitResult,
    KeyState,
    Planner,
    PolicyTerms,
    answer_of,
    cap_terms,
    fallback_answer,
    ratelimit_headers,
    unvouched_of,
)
from spendgate.admission.exceptions import BadRequest
from spendgate.admission.fallback import DegradedLedger
from spendgate.admission.scripts.admit import AdmitTarget, TargetTemplate
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.matching import targets
from spendgate.schemas.policies import Policy


def policy(id: str, **fields: Any) -> Policy:  # noqa: A002 - the policy field's name
    return Policy.model_validate({"id": id, "unit": "total_tokens", "limit": 1000, **fields})


def result(keys: list[KeyState], **fields: Any) -> AdmitResult:
    base: dict[str, Any] = {
        "replayed": False,
        "outcome": "allow",
        "now_ms": 1_000_000,
        "retry_after_ms": None,
        "never_fits": False,
        "reservation_id": "r1",
        "plan": 0,
        "max_output_tokens": None,
        "keys": tuple(keys),
    }
    return AdmitResult(**{**base, **fields})


def key(used: int = 0, **fields: Any) -> KeyState:
    base: dict[str, Any] = {
        "used": used,
        "reserved": 0,
        "own": 0,
        "violated": False,
        "reset_after_ms": 0,
    }
    return KeyState(**{**base, **fields})


SUBJECT = Subject(tenant="acme", team="ml", model="big")
ESTIMATE = Usage(requests=1, input_tokens=100, output_tokens=50)


class TestPlanner:
    def test_targets_equal_the_unindexed_matching(self) -> None:
        policies = [
            policy("all"),
            policy("acme", match={"tenant": "acme"}, group_by=["team"]),
            policy("other", match={"tenant": "other"}),
            policy("glob", match={"model": "b*"}),
            policy("two", match={"tenant": "acme", "model": "small"}),
        ]
        plans = Planner(policies, None).plans(SUBJECT, ESTIMATE)
        got = [(c.target.policy.id, c.target.key) for c in plans[0].charges]
        want = [(t.policy.id, t.key) for t in targets(policies, SUBJECT)]
        assert got == want == [("acme", "acme|team=ml"), ("all", "all"), ("glob", "glob")]
        assert [c.amount for c in plans[0].charges] == [150, 150, 150]

    def test_ten_thousand_policies_one_lookup(self) -> None:
        policies = [policy(f"p{i}", match={"tenant": f"t{i}"}) for i in range(10_000)]
        planner = Planner(policies, None)
        plans = planner.plans(Subject(tenant="t4242"), ESTIMATE)
        assert [c.target.policy.id for c in plans[0].charges] == ["p4242"]

    def test_missing_group_by_field_names_it(self) -> None:
        planner = Planner([policy("k", group_by=["api_key"])], None)
        with pytest.raises(BadRequest) as info:
            planner.plans(SUBJECT, ESTIMATE)
        assert info.value.field == "subject.api_key"

    def test_downgrade_plan_and_alt_index(self) -> None:
        policies = [
            policy("dg", match={"model": "big"}, on_exceed="downgrade", downgrade_to="small"),
            policy("small", match={"model": "small"}),
        ]
        plans = Planner(policies, None).plans(SUBJECT, ESTIMATE)
        assert len(plans) == 2
        assert plans[0].charges[0].alt == 1
        assert plans[1].subject.model == "small"
        assert [c.target.policy.id for c in plans[1].charges] == ["small"]

    def test_terms_are_precomputed_once_per_policy(self) -> None:
        p = policy("w", window="1h", bucket="1m", reservation_ttl="10m")
        planner = Planner([p], None)
        terms = planner.plans(SUBJECT, ESTIMATE)[0].charges[0].terms
        assert terms is planner.terms["w"]
        assert (terms.window_ms, terms.window_s, terms.reservation_ttl_ms) == (
            3_600_000,
            3600,
            600_000,
        )


class TestTemplate:
    @pytest.mark.parametrize("observe", [False, True])
    def test_template_argv_equals_the_typed_encoder(self, observe: bool) -> None:
        typed = AdmitTarget(
            limit=10,
            window_ms=60_000,
            bucket_ms=1000,
            boundary="prorate",
            amount=7,
            reservation_ttl_ms=900_000,
            observe=observe,
            on_exceed=1,
            downgrade_plan=2,
            cap_s=3,
            cap_r=4,
            cap_d=5,
            deps=(1, 3),
            failure=2,
        )
        template = TargetTemplate.of(
            limit=10,
            window_ms=60_000,
            bucket_ms=1000,
            boundary="prorate",
            reservation_ttl_ms=900_000,
            observe=observe,
            on_exceed=1,
            failure=2,
        )
        assert template.argv(7, 2, 3, 4, 5, "1,3") == typed.argv()

    def test_policy_terms_encode_the_policy(self) -> None:
        p = policy("c", on_exceed="cap", failure="degraded", mode="observe", limit=77)
        args = PolicyTerms.of(p).template.argv(5, 0, 0, 1, 1, "1")
        assert args[:4] == [77, p.window_ms, p.bucket_ms, "include"]
        assert args[4:8] == [5, p.reservation_ttl_ms, 1, 1]
        assert args[-2:] == [2, ""]

    def test_policy_terms_encode_the_burst(self) -> None:
        p = policy("b", burst={"rate": 3, "per": "2s", "capacity": 10})
        terms = PolicyTerms.of(p)
        assert terms.template.argv(5, 0, 0, 1, 1, "1")[-1] == "3:2000:10"
        assert terms.burst is not None and terms.burst.full == 20_000


class TestCapTerms:
    def test_units(self) -> None:
        est = Usage(input_tokens=100, cached_input_tokens=20, output_tokens=50)
        out = cap_terms(policy("o", unit="output_tokens"), est, None, "m")
        assert (out.s, out.r, out.d) == (0, 1, 1)
        tot = cap_terms(policy("t"), est, None, "m")
        assert (tot.s, tot.r, tot.d) == (120, 1, 1)
        no_cached = cap_terms(policy("t", count_cached_input=False), est, None, "m")
        assert no_cached.s == 100
        assert cap_terms(policy("r", unit="requests"), est, None, "m").r == 0


class TestAnswer:
    def test_allow_body_is_the_decision_model_dumped(self) -> None:
        planner = Planner([policy("a"), policy("b", limit=500)], None)
        plans = planner.plans(SUBJECT, ESTIMATE)
        res = result([key(100, own=150, reset_after_ms=1500), key(450, own=150)])
        answer = answer_of(res, plans, SUBJECT)
        assert answer.status == 200
        model = Decision.model_validate(answer.body)
        assert answer.body == model.model_dump(mode="json", exclude_none=True)
        assert answer.body["budgets"][0]["remaining"] == 750
        assert answer.body["budgets"][0]["reset_after_seconds"] == 2
        assert answer.headers["Spendgate-Decision"] == "allow"
        # The tightest budget: b has nothing left.
        assert answer.headers["RateLimit"] == '"b";r=0;t=0'

    def test_reject_carries_retry_after_and_no_reservation(self) -> None:
        plans = Planner([policy("a")], None).plans(SUBJECT, ESTIMATE)
        res = result([key(900, violated=True)], outcome="reject", retry_after_ms=1001)
        answer = answer_of(res, plans, SUBJECT)
        assert answer.status == 429
        assert "reservation_id" not in answer.body
        assert answer.body["violated"] == ["a"]
        assert answer.headers["Retry-After"] == "2"

    def test_never_fits_has_no_retry(self) -> None:
        plans = Planner([policy("a")], None).plans(SUBJECT, ESTIMATE)
        res = result([key(violated=True)], outcome="reject", never_fits=True)
        answer = answer_of(res, plans, SUBJECT)
        assert answer.body["never_fits"] is True
        assert "Retry-After" not in answer.headers

    def test_downgraded_plan_is_labelled(self) -> None:
        policies = [
            policy("dg", match={"model": "big"}, on_exceed="downgrade", downgrade_to="small"),
            policy("small", match={"model": "small"}),
        ]
        plans = Planner(policies, None).plans(SUBJECT, ESTIMATE)
        answer = answer_of(result([key(own=150)], plan=1), plans, SUBJECT)
        assert answer.body["decision"] == "downgrade"
        assert answer.body["model"] == "small"

    def test_ratelimit_headers_accept_models_too(self) -> None:
        plans = Planner([policy("a")], None).plans(SUBJECT, ESTIMATE)
        answer = answer_of(result([key(10)]), plans, SUBJECT)
        model = Decision.model_validate(answer.body)
        assert ratelimit_headers(model.budgets) == ratelimit_headers(answer.body["budgets"])


class TestFailureModes:
    def test_closed_wins(self) -> None:
        plans = Planner([policy("c", failure="closed"), policy("o", failure="open")], None).plans(
            SUBJECT, ESTIMATE
        )
        out = fallback_answer(DegradedLedger(), plans[0].charges, "big", 0, "r", 900_000)
        assert out.mode == "closed"
        assert out.closed == ("c",)
        assert out.answer is None

    def test_degraded_spends_the_allowance_then_refuses(self) -> None:
        plans = Planner([policy("d", failure="degraded", degraded_allowance=0.2)], None).plans(
            SUBJECT, ESTIMATE
        )
        ledger = DegradedLedger()
        first = fallback_answer(ledger, plans[0].charges, "big", 0, "r1", 900_000)
        assert first.admitted and first.answer is not None
        assert first.answer.headers["Spendgate-Fallback"] == "degraded"
        second = fallback_answer(ledger, plans[0].charges, "big", 1, "r2", 900_000)
        assert not second.admitted and second.answer is not None
        assert second.answer.status == 429
        assert second.answer.body["violated"] == ["d"]

    def test_degraded_retry_is_the_local_window_end_and_never_fits_above_the_allowance(
        self,
    ) -> None:
        # 24 h window; the allowance 200 holds one estimate of 150 per local window.
        plans = Planner([policy("d", failure="degraded", degraded_allowance=0.2)], None).plans(
            SUBJECT, ESTIMATE
        )
        ledger = DegradedLedger()
        now = 86_400_000 * 3 + 1_000
        assert fallback_answer(ledger, plans[0].charges, "big", now, "r1", 900_000).admitted
        second = fallback_answer(ledger, plans[0].charges, "big", now + 500, "r2", 900_000)
        assert second.answer is not None and not second.admitted
        assert second.answer.body["retry_after_seconds"] == 86_400 - 1  # ceil(86_398_500 ms)
        assert second.answer.body["never_fits"] is False
        assert second.answer.body["budgets"][0]["reserved"] == 150  # the refusal held nothing
        small = Planner([policy("s", failure="degraded", degraded_allowance=0.1)], None).plans(
            SUBJECT, ESTIMATE
        )
        out = fallback_answer(DegradedLedger(), small[0].charges, "big", now, "r3", 900_000)
        assert out.answer is not None and not out.admitted
        assert out.answer.body["never_fits"] is True
        assert "retry_after_seconds" not in out.answer.body

    def test_open_admits_without_budgets(self) -> None:
        plans = Planner([policy("o", failure="open")], None).plans(SUBJECT, ESTIMATE)
        out = fallback_answer(DegradedLedger(), plans[0].charges, "big", 0, "r", 900_000)
        assert out.admitted and out.answer is not None
        assert out.answer.body["reservation_id"] == "r"
        assert out.answer.body["budgets"] == []

    def test_unvouched_names_blocking_keys(self) -> None:
        plans = Planner([policy("c", failure="closed"), policy("o", failure="open")], None).plans(
            SUBJECT, ESTIMATE
        )
        res = result([key(state="stale"), key(state="missing")], outcome="unvouched")
        keys = unvouched_of(plans, res)
        assert [c.target.policy.id for c in keys.blocking] == ["c"]
        assert keys.state == "stale"
        assert keys.closed == ("c",)
