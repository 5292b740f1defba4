"""The gateway rules apart from any gateway: subject mapping, usage, refusal shapes."""

from __future__ import annotations

import pytest

from spendgate.integrations.gateway import (
    MAX_RETRY_AFTER_S,
    RequestView,
    check_mapping,
    estimate_of,
    refusal_of,
    subject_of,
    unavailable_refusal,
    usage_of,
)
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject, Usage


def _reject(**fields: object) -> Decision:
    budget = {
        "policy": "p-day",
        "key": "p-day|tenant=acme",
        "unit": "requests",
        "limit": 10,
        "used": 10,
        "reserved": 0,
        "remaining": 0,
        "window_seconds": 86400,
        "reset_after_seconds": 100,
    }
    return Decision.model_validate(
        {"decision": "reject", "violated": ["p-day"], "budgets": [budget], **fields}
    )


class TestSubject:
    VIEW = RequestView(
        key="hash-1",
        team_id=None,
        key_alias="alias-1",
        user_id="u1",
        model="big",
        metadata={"tenant": "acme", "region": "eu", "empty": ""},
    )

    def test_each_field_comes_from_the_first_source_present(self) -> None:
        mapping = {
            "tenant": "team_id|metadata.tenant",
            "api_key": "key",
            "user": "user_id",
            "model": "model",
            "labels.region": "metadata.region",
            "project": "metadata.missing|metadata.empty",
        }
        assert subject_of(mapping, self.VIEW) == Subject(
            tenant="acme", api_key="hash-1", user="u1", model="big", labels={"region": "eu"}
        )

    def test_team_wins_when_present(self) -> None:
        view = RequestView(team_id="team-9", metadata={"tenant": "acme"})
        assert subject_of({"tenant": "team_id|metadata.tenant"}, view).tenant == "team-9"

    @pytest.mark.parametrize(
        ("mapping", "named"),
        [({"tenant": "teamid"}, "teamid"), ({"owner": "team_id"}, "owner")],
    )
    def test_a_mapping_naming_an_unknown_field_or_source_is_refused(
        self, mapping: dict[str, str], named: str
    ) -> None:
        with pytest.raises(ValueError, match=named):
            check_mapping(mapping)

    def test_the_default_mapping_is_valid(self) -> None:
        check_mapping({"tenant": "team_id", "api_key": "key", "labels.x": "metadata.x"})


class TestUsage:
    def test_cached_tokens_are_counted_apart_from_the_prompt(self) -> None:
        assert usage_of(40, 5, cached_tokens=8) == Usage(
            requests=1, input_tokens=32, cached_input_tokens=8, output_tokens=5
        )

    def test_a_cost_is_rounded_up_to_the_micro_dollar(self) -> None:
        assert usage_of(1, 1, cost_usd=0.0000011).cost_usd_micros == 2
        assert usage_of(1, 1, cost_usd=0.0).cost_usd_micros is None

    def test_the_estimate_is_the_prompt_and_the_output_allowed(self) -> None:
        assert estimate_of(12, 200) == Usage(requests=1, input_tokens=12, output_tokens=200)


class TestRefusal:
    def test_a_short_wait_says_retry_after_in_seconds_and_ms(self) -> None:
        refusal = refusal_of(_reject(retry_after_seconds=7))
        assert (refusal.status, refusal.type) == (429, "rate_limit_error")
        assert refusal.headers == {
            "retry-after": "7",
            "retry-after-ms": "7000",
            "x-should-retry": "true",
        }
        assert refusal.details["policy"] == "p-day" and refusal.details["remaining"] == 0

    def test_a_wait_over_the_longest_retry_says_do_not_retry(self) -> None:
        refusal = refusal_of(_reject(retry_after_seconds=MAX_RETRY_AFTER_S + 1))
        assert refusal.type == "insufficient_quota"
        assert refusal.headers["x-should-retry"] == "false"
        assert refusal.headers["retry-after"] == str(MAX_RETRY_AFTER_S + 1)
        assert "frees up in 61 s" in refusal.message

    def test_a_wait_of_exactly_the_longest_retry_is_retried(self) -> None:
        refusal = refusal_of(_reject(retry_after_seconds=MAX_RETRY_AFTER_S))
        assert refusal.headers["x-should-retry"] == "true"

    def test_never_fits_says_do_not_retry_and_why(self) -> None:
        refusal = refusal_of(_reject(never_fits=True))
        assert refusal.type == "insufficient_quota"
        assert refusal.headers == {"x-should-retry": "false"}
        assert refusal.details["never_fits"] is True and "p-day" in refusal.message

    def test_unavailable_is_a_short_retriable_503(self) -> None:
        refusal = unavailable_refusal("connection refused")
        assert refusal.status == 503 and refusal.headers["x-should-retry"] == "true"
        assert "connection refused" in refusal.message
