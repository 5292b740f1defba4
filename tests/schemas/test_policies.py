"""Policy validation: every refusal names its field; valid policies round-trip unchanged."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from spendgate.schemas import (
    MissingGroupByField,
    ModelPrice,
    Policy,
    PolicyError,
    PriceCatalog,
    Subject,
    targets,
    validate_against_catalog,
)

VALID: dict[str, Any] = {"id": "acme-daily", "unit": "total_tokens", "limit": 1000}


class _Drop:
    """A change value meaning "leave this field out" (one repr: test ids must be stable)."""

    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()

_PRICE = ModelPrice(input_per_mtok_micros=3_000_000, output_per_mtok_micros=15_000_000)
CATALOG = PriceCatalog(list_prices={"claude-haiku-*": _PRICE, "gpt-small": _PRICE})
CATALOG_WITH_DEFAULT = CATALOG.model_copy(update={"default": _PRICE})


def refused_fields(change: dict[str, Any]) -> set[str]:
    """Validate ``VALID`` with ``change`` and the catalog; return the fields the refusal names.

    A field is named by an error's ``loc`` or, for rules across fields (empty ``loc``)
    and for catalog rules, by the ``field:`` prefix of the message.
    """
    fields = {k: v for k, v in {**VALID, **change}.items() if v is not DROP}
    try:
        policy = Policy.model_validate(fields)
    except ValidationError as exc:
        named: set[str] = set()
        for error in exc.errors():
            named.update(str(part) for part in error["loc"])
            named.add(".".join(str(part) for part in error["loc"]))
            if not error["loc"]:
                named.add(error["msg"].removeprefix("Value error, ").split(":", 1)[0])
        return named
    try:
        validate_against_catalog(policy, CATALOG)
    except PolicyError as exc:
        return {str(exc).split(":", 1)[0]}
    pytest.fail(f"policy with {change} was accepted")


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"id": "Has Spaces"}, "id"),
    ({"forecast": "soon"}, "forecast"),
    ({"forecast": 7200}, "forecast"),
    ({"forecast": "48h"}, "forecast"),
    ({"forecast": "0s"}, "forecast"),
    ({"id": ""}, "id"),
    ({"id": "x" * 65}, "id"),
    ({"id": DROP}, "id"),
    ({"unit": "dollars"}, "unit"),
    ({"unit": DROP}, "unit"),
    ({"limit": 0}, "limit"),
    ({"limit": -5}, "limit"),
    ({"limit": 2**53}, "limit"),
    ({"limit": 1.5}, "limit"),
    ({"limit": "1000"}, "limit"),
    ({"limit": True}, "limit"),
    ({"window": "10s"}, "window"),
    ({"window": "29999ms"}, "window"),
    ({"window": "32d"}, "window"),
    ({"window": "soon"}, "window"),
    ({"window": "0s"}, "window"),
    ({"window": "1 h"}, "window"),
    ({"bucket": "1500ms"}, "bucket"),
    ({"bucket": "0m"}, "bucket"),
    ({"window": "1h", "bucket": "7m"}, "bucket"),
    ({"window": "1m", "bucket": "2m"}, "bucket"),
    ({"boundary": "middle"}, "boundary"),
    ({"mode": "dry-run"}, "mode"),
    ({"on_exceed": "throttle"}, "on_exceed"),
    ({"on_exceed": "downgrade"}, "downgrade_to"),
    ({"downgrade_to": "gpt-small"}, "downgrade_to"),
    ({"on_exceed": "downgrade", "downgrade_to": "claude-*"}, "downgrade_to"),
    ({"on_exceed": "downgrade", "downgrade_to": ""}, "downgrade_to"),
    ({"on_exceed": "downgrade", "downgrade_to": "no-such-model"}, "downgrade_to"),
    ({"alerts": [0.8, 0.5]}, "alerts"),
    ({"alerts": [0.5, 0.5]}, "alerts"),
    ({"alerts": [1.5]}, "alerts"),
    ({"alerts": [0]}, "alerts"),
    ({"alerts": 0.5}, "alerts"),
    ({"failure": "maybe"}, "failure"),
    ({"degraded_allowance": 0}, "degraded_allowance"),
    ({"degraded_allowance": 1.01}, "degraded_allowance"),
    ({"reservation_ttl": "500ms"}, "reservation_ttl"),
    ({"reservation_ttl": "25h"}, "reservation_ttl"),
    ({"count_cached_input": "yes"}, "count_cached_input"),
    ({"unpriced": "free"}, "unpriced"),
    ({"unit": "cost_usd", "unpriced": "charge_default"}, "unpriced"),
    ({"match": {"colour": "red"}}, "match"),
    ({"match": {"tenant": ""}}, "match"),
    ({"match": {"labels.": "x"}}, "match"),
    ({"group_by": ["colour"]}, "group_by"),
    ({"group_by": ["tenant", "tenant"]}, "group_by"),
    ({"group_by": ["labels."]}, "group_by"),
    ({"group_by": "tenant"}, "group_by"),
    ({"surprise": 1}, "surprise"),
    ({"burst": {"rate": 1, "per": "1s", "capacity": 0}}, "burst.capacity"),
    ({"burst": {"rate": 0, "capacity": 10}}, "burst.rate"),
    ({"burst": {"rate": 1, "capacity": True}}, "burst.capacity"),
    ({"burst": {"rate": 1}}, "burst.capacity"),
    ({"burst": {"rate": 1, "capacity": 10, "per": "soon"}}, "burst.per"),
    ({"burst": {"rate": 1, "capacity": 10, "per": "2d"}}, "burst.per"),
    ({"burst": {"rate": 1, "capacity": 2**52, "per": "1s"}}, "burst"),
    ({"burst": {"rate": 1, "capacity": 10, "size": 3}}, "burst.size"),
    ({"burst": 10}, "burst"),
    ({"on_exceed": "route"}, "route_to"),
    ({"route_to": "gpu-west"}, "route_to"),
    ({"on_exceed": "route", "route_to": "gpu-*"}, "route_to"),
    ({"on_exceed": "route", "route_to": ""}, "route_to"),
    ({"on_exceed": "wait"}, "on_exceed"),
    ({"max_delay": "2s"}, "max_delay"),
    ({"on_exceed": "delay", "max_delay": "2m"}, "max_delay"),
    ({"on_exceed": "delay", "max_delay": "soon"}, "max_delay"),
    ({"on_exceed": "delay", "max_delay": 5}, "max_delay"),
    ({"overage": "ignore"}, "overage"),
    ({"overage": True}, "overage"),
]

VALID_POLICIES: list[dict[str, Any]] = [
    VALID,
    {
        "id": "everything.explicit_1",
        "match": {"tenant": "acme", "model": "claude-opus-*"},
        "group_by": ["team", "api_key"],
        "unit": "cost_usd",
        "limit": 50_000_000,
        "window": "7d",
        "bucket": "1h",
        "boundary": "exclude",
        "mode": "observe",
        "on_exceed": "downgrade",
        "downgrade_to": "claude-haiku-4",
        "alerts": [0.25, 0.9],
        "failure": "degraded",
        "degraded_allowance": 0.05,
        "reservation_ttl": "5m",
        "count_cached_input": False,
        "unpriced": "charge_default",
    },
    {"id": "per-key", "unit": "requests", "limit": 60, "window": "1m", "group_by": ["api_key"]},
    {
        "id": "labels",
        "unit": "input_tokens",
        "limit": 5,
        "match": {"labels.feature": "chat*", "labels.a|b=c": "x"},
        "group_by": ["labels.region", "user"],
    },
    {"id": "shortest", "unit": "output_tokens", "limit": 1, "window": "30s", "bucket": "1s"},
    {"id": "longest", "unit": "gpu_seconds", "limit": 2**53 - 1, "window": "31d", "bucket": "1d"},
    {"id": "ms-spelling", "unit": "requests", "limit": 10, "window": "90000ms", "bucket": "30s"},
    {"id": "cap", "unit": "output_tokens", "limit": 4096, "on_exceed": "cap", "mode": "observe"},
    {"id": "no-alerts", "unit": "requests", "limit": 3, "alerts": []},
    {"id": "int-alert", "unit": "requests", "limit": 3, "alerts": [1]},
    {"id": "open", "unit": "total_tokens", "limit": 9, "failure": "open", "boundary": "prorate"},
    {"id": "ttl", "unit": "requests", "limit": 2, "reservation_ttl": "24h", "window": "48h"},
    {"id": "full-degraded", "unit": "requests", "limit": 2, "degraded_allowance": 1},
    {
        "id": "bursty",
        "unit": "requests",
        "limit": 100,
        "burst": {"rate": 5, "per": "1s", "capacity": 20},
    },
    {
        "id": "routed",
        "unit": "requests",
        "limit": 5,
        "match": {"pool": "gpu-east"},
        "group_by": ["pool"],
        "on_exceed": "route",
        "route_to": "gpu-west",
    },
    {"id": "delayed", "unit": "requests", "limit": 5, "on_exceed": "delay", "max_delay": "2s"},
    {"id": "delayed-default", "unit": "requests", "limit": 5, "on_exceed": "delay"},
    {
        "id": "burst-hourly",
        "unit": "cost_usd",
        "limit": 9,
        "burst": {"rate": 1, "per": "1h", "capacity": 3},
    },
    {"id": "forecast", "unit": "requests", "limit": 2, "forecast": "2h"},
    {"id": "chronic", "unit": "output_tokens", "limit": 9, "overage": "cap_next"},
]


class TestPolicyValidation:
    @pytest.mark.parametrize(("change", "field"), INVALID, ids=lambda x: repr(x)[:60])
    def test_bad_policies_are_refused_naming_the_field(
        self, change: dict[str, Any], field: str
    ) -> None:
        assert field in refused_fields(change)

    def test_the_table_is_large_enough(self) -> None:
        assert len(INVALID) >= 30
        assert len(VALID_POLICIES) >= 10

    def test_defaults(self) -> None:
        policy = Policy.model_validate(VALID)
        assert (policy.window, policy.bucket, policy.boundary) == ("24h", "1m", "include")
        assert (policy.window_ms, policy.bucket_ms, policy.reservation_ttl_ms) == (
            86_400_000,
            60_000,
            900_000,
        )
        assert (policy.unpriced, policy.count_cached_input) == ("reject", True)
        assert policy.alerts == [0.5, 0.8, 1.0]

    @pytest.mark.parametrize("fields", VALID_POLICIES, ids=lambda f: f["id"])
    def test_valid_policies_round_trip_through_json_unchanged(self, fields: dict[str, Any]) -> None:
        policy = Policy.model_validate(fields)
        dumped = policy.model_dump_json()
        again = Policy.model_validate_json(dumped)
        assert again == policy
        assert again.model_dump_json() == dumped
        # What the author wrote is what is stored (durations keep their spelling).
        assert {k: json.loads(dumped)[k] for k in fields} == fields

    @pytest.mark.parametrize("fields", VALID_POLICIES, ids=lambda f: f["id"])
    def test_valid_policies_pass_the_catalog_check(self, fields: dict[str, Any]) -> None:
        validate_against_catalog(Policy.model_validate(fields), CATALOG_WITH_DEFAULT)

    def test_a_downgrade_target_priced_by_a_glob_or_override_is_accepted(self) -> None:
        catalog = PriceCatalog(
            overrides={"special": _PRICE}, list_prices={"claude-haiku-*": _PRICE}
        )
        for target in ("special", "claude-haiku-4"):
            policy = Policy.model_validate(
                {**VALID, "on_exceed": "downgrade", "downgrade_to": target}
            )
            validate_against_catalog(policy, catalog)

    def test_the_catalog_default_does_not_price_a_downgrade_target(self) -> None:
        policy = Policy.model_validate({**VALID, "on_exceed": "downgrade", "downgrade_to": "other"})
        with pytest.raises(PolicyError, match=r"^downgrade_to: .*'other'"):
            validate_against_catalog(policy, CATALOG_WITH_DEFAULT)

    def test_policies_are_frozen(self) -> None:
        policy = Policy.model_validate(VALID)
        with pytest.raises(ValidationError):
            policy.limit = 5  # type: ignore[misc]


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
