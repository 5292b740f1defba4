"""Policy validation and matching (first version; the full table comes with the schemas issue)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from schemas import MissingGroupByField, Policy, Subject, targets

VALID: dict[str, Any] = {"id": "acme-daily", "unit": "total_tokens", "limit": 1000}


class TestPolicyValidation:
    @pytest.mark.parametrize(
        ("change", "field"),
        [
            ({"id": "Has Spaces"}, "id"),
            ({"limit": 0}, "limit"),
            ({"unit": "dollars"}, "unit"),
            ({"window": "10s"}, "window"),
            ({"window": "32d"}, "window"),
            ({"window": "1h", "bucket": "7m"}, "bucket"),
            ({"window": "1m", "bucket": "2m"}, "bucket"),
            ({"alerts": [0.8, 0.5]}, "alerts"),
            ({"alerts": [1.5]}, "alerts"),
            ({"on_exceed": "downgrade"}, "downgrade_to"),
            ({"group_by": ["colour"]}, "group_by"),
            ({"window": "soon"}, "window"),
            ({"surprise": 1}, "surprise"),
        ],
    )
    def test_bad_policies_are_refused_naming_the_field(
        self, change: dict[str, Any], field: str
    ) -> None:
        with pytest.raises(ValidationError) as info:
            Policy.model_validate({**VALID, **change})
        assert field in str(info.value)

    def test_defaults_round_trip_through_json(self) -> None:
        policy = Policy.model_validate(VALID)
        assert (policy.window, policy.bucket, policy.boundary) == ("24h", "1m", "include")
        assert Policy.model_validate_json(policy.model_dump_json()) == policy


class TestMatching:
    def test_globs_select_and_group_by_builds_escaped_keys(self) -> None:
        opus = Policy.model_validate(
            {**VALID, "id": "opus", "match": {"model": "claude-opus-*"}, "group_by": ["api_key"]}
        )
        every = Policy.model_validate({**VALID, "id": "all"})
        subject = Subject(model="claude-opus-4", api_key="k|1=x")
        found = targets([opus, every], subject)
        assert [(t.policy.id, t.key) for t in found] == [
            ("all", "all"),
            ("opus", "opus|api_key=k%7C1%3Dx"),
        ]
        assert [t.policy.id for t in targets([opus, every], Subject(model="gpt"))] == ["all"]

    def test_a_subject_missing_a_group_by_field_is_an_error_naming_it(self) -> None:
        policy = Policy.model_validate({**VALID, "group_by": ["tenant"]})
        with pytest.raises(MissingGroupByField, match="tenant"):
            targets([policy], Subject(model="m"))
