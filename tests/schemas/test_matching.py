"""Matching and budget keys: globs, escaping, and keys that never collide."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas import (
    MissingGroupByField,
    Policy,
    PolicyIndex,
    Subject,
    budget_key,
    matches,
    targets,
)
from spendgate.schemas.matching import parse_key

NASTY = "|=%{}\"'\\"
values = st.text(
    alphabet=st.sampled_from(NASTY) | st.characters(exclude_categories=("Cs",)),
    min_size=1,
    max_size=12,
)

#: Fixed fields plus labels whose names hold every separator.
GROUP_BY = ["tenant", "api_key", "labels.a|b=c", "labels.%7C", "labels.{x}"]
POLICY = Policy.model_validate(
    {"id": "acme.daily_1", "unit": "requests", "limit": 1, "group_by": GROUP_BY}
)


def subject(vals: tuple[str, ...]) -> Subject:
    tenant, api_key, *labels = vals
    names = [field.removeprefix("labels.") for field in GROUP_BY[2:]]
    return Subject(tenant=tenant, api_key=api_key, labels=dict(zip(names, labels, strict=True)))


value_tuples = st.tuples(*[values] * len(GROUP_BY))


class TestBudgetKey:
    def test_the_format_is_readable_and_unchanged_for_plain_fields(self) -> None:
        policy = Policy.model_validate(
            {"id": "acme-daily", "unit": "requests", "limit": 1, "group_by": ["tenant"]}
        )
        assert budget_key(policy, Subject(tenant="acme")) == f"{policy.id}|tenant=acme"
        bare = Policy.model_validate({"id": "all", "unit": "requests", "limit": 1})
        assert budget_key(bare, Subject()) == "all"

    def test_label_names_and_values_are_escaped(self) -> None:
        key = budget_key(POLICY, subject(("t", "k", "v|1", "%", "{}")))
        assert key == (
            "acme.daily_1|tenant=t|api_key=k|labels.a%7Cb%3Dc=v%7C1"
            "|labels.%257C=%25|labels.%7Bx%7D=%7B%7D"
        )
        assert "{" not in key and "}" not in key

    @given(value_tuples, value_tuples)
    def test_different_values_never_share_a_key(
        self, left: tuple[str, ...], right: tuple[str, ...]
    ) -> None:
        if left != right:
            assert budget_key(POLICY, subject(left)) != budget_key(POLICY, subject(right))

    @given(value_tuples)
    def test_the_key_is_stable_and_splits_back_into_its_values(self, vals: tuple[str, ...]) -> None:
        key = budget_key(POLICY, subject(vals))
        assert key == budget_key(POLICY, subject(vals))
        assert key == budget_key(
            POLICY.model_copy(), Subject.model_validate(subject(vals).model_dump())
        )
        parts = key.split("|")
        assert len(parts) == 1 + len(GROUP_BY)
        assert all(part.count("=") == 1 for part in parts[1:])

    @given(value_tuples)
    def test_parse_key_gives_back_the_policy_and_every_value(self, vals: tuple[str, ...]) -> None:
        policy_id, fields = parse_key(budget_key(POLICY, subject(vals)))
        assert policy_id == POLICY.id
        assert fields == dict(zip(GROUP_BY, vals, strict=True))


class TestMatches:
    def policy(self, match: dict[str, Any]) -> Policy:
        return Policy.model_validate({"id": "p", "unit": "requests", "limit": 1, "match": match})

    def test_empty_match_selects_every_subject(self) -> None:
        assert matches(self.policy({}), Subject())

    def test_exact_glob_and_label_entries_must_all_select(self) -> None:
        policy = self.policy({"model": "claude-opus-*", "env": "prod", "labels.tier": "gold"})
        chosen = Subject(model="claude-opus-4", env="prod", labels={"tier": "gold"})
        assert matches(policy, chosen)
        assert not matches(policy, chosen.model_copy(update={"env": "dev"}))
        assert not matches(policy, chosen.model_copy(update={"model": "Claude-opus-4"}))
        assert not matches(policy, chosen.model_copy(update={"labels": {}}))
        assert not matches(policy, chosen.model_copy(update={"model": None}))


FIELD_VALUES = st.sampled_from(["a", "b", "ab", "m1", "m2"])
PATTERNS = FIELD_VALUES | st.sampled_from(["a*", "m?", "[ab]", "*", "m[!1]"])
MATCH_FIELDS = ["tenant", "model", "api_key", "labels.x"]


@st.composite
def policy_sets(draw: st.DrawFn) -> list[Policy]:
    out = []
    for n in range(draw(st.integers(0, 12))):
        match = draw(st.dictionaries(st.sampled_from(MATCH_FIELDS), PATTERNS, max_size=3))
        group_by = draw(st.lists(st.sampled_from(MATCH_FIELDS), unique=True, max_size=2))
        out.append(
            Policy.model_validate(
                {"id": f"p{draw(st.integers(0, 99)):02d}-{n}", "unit": "requests", "limit": 1,
                 "match": match, "group_by": group_by}
            )
        )  # fmt: skip
    return out


@st.composite
def subjects(draw: st.DrawFn) -> Subject:
    values = {f: draw(st.none() | FIELD_VALUES) for f in ("tenant", "model", "api_key")}
    label = draw(st.none() | FIELD_VALUES)
    return Subject(**{k: v for k, v in values.items() if v}, labels={"x": label} if label else {})


def outcome(find: Any) -> Any:
    try:
        return [(t.policy.id, t.key) for t in find()]
    except MissingGroupByField as exc:
        return str(exc)


class TestPolicyIndex:
    @given(policies=policy_sets(), subject=subjects())
    def test_it_finds_what_a_scan_finds_in_the_same_order(
        self, policies: list[Policy], subject: Subject
    ) -> None:
        index = PolicyIndex(policies)
        assert outcome(lambda: index.targets(subject)) == outcome(
            lambda: targets(policies, subject)
        )

    def test_policies_are_filed_by_an_exact_field_and_globs_are_scanned(self) -> None:
        exact = Policy.model_validate(
            {"id": "e", "unit": "requests", "limit": 1, "match": {"model": "m*", "tenant": "a"}}
        )
        glob = Policy.model_validate(
            {"id": "g", "unit": "requests", "limit": 1, "match": {"model": "m*"}}
        )
        index = PolicyIndex([glob, exact])
        assert [p.id for p in index.matching(Subject(tenant="a", model="m1"))] == ["e", "g"]
        assert [p.id for p in index.matching(Subject(tenant="b", model="m1"))] == ["g"]
        assert [p.id for p in index.matching(Subject(tenant="a", model="x"))] == []
