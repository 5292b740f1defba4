"""Which policies apply to a subject, and the budget key each one counts under."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Protocol

from spendgate.schemas.exceptions import MissingGroupByField
from spendgate.schemas.policies import Policy

#: Characters that make a ``match`` value a glob (``fnmatch``); without them it is exact.
GLOB_CHARS = frozenset("*?[")
#: The order in which an exact ``match`` field is chosen to index a policy by: the fields
#: most likely to be unique to it first.
_INDEX_ORDER = ("tenant", "api_key", "user", "project", "team", "env", "model", "pool")


class SubjectView(Protocol):
    """What matching reads of a subject: :class:`schemas.events.Subject` or a fast-decoded one."""

    def value(self, field: str) -> str | None:
        """A subject field, or ``labels.NAME`` for a free label (``None``: absent)."""
        ...


@dataclass(frozen=True, slots=True)
class BudgetTarget:
    """A policy applied to one subject: the counter to check and charge."""

    policy: Policy
    key: str


def matches(policy: Policy, subject: SubjectView) -> bool:
    """Return whether every ``match`` entry selects the subject.

    Args:
        policy: the policy.
        subject: the subject.

    Returns:
        True when each matched field is present and equals the value or fits the glob
        (case-sensitive); ``{}`` matches every subject.
    """
    for field, pattern in policy.match.items():
        value = subject.value(field)
        if value is None or not fnmatchcase(value, pattern):
            return False
    return True


def _escape(value: str) -> str:
    # Percent-encode the key's own separators (and the escape character itself) so no
    # policy id, field name or subject value can address another key.
    return (
        value.replace("%", "%25")
        .replace("|", "%7C")
        .replace("=", "%3D")
        .replace("{", "%7B")
        .replace("}", "%7D")
    )


def budget_key(policy: Policy, subject: SubjectView) -> str:
    """The readable, collision-free key ``policy|field=value|...`` of ``group_by`` values.

    The policy id, each field name (``labels.NAME`` may hold any character) and each
    value are escaped: ``%`` ``|`` ``=`` ``{`` ``}`` become ``%25`` ``%7C`` ``%3D``
    ``%7B`` ``%7D``. Braces are escaped so no value can inject a Redis Cluster hash tag.
    For one policy, different value tuples therefore always give different keys.

    Args:
        policy: the policy.
        subject: the subject the request is for.

    Returns:
        The budget key, for example ``acme-daily|api_key=k1``.

    Raises:
        MissingGroupByField: the subject lacks a field the policy groups by.
    """
    parts = [_escape(policy.id)]
    for field in policy.group_by:
        value = subject.value(field)
        if value is None:
            raise MissingGroupByField(policy.id, field)
        parts.append(f"{_escape(field)}={_escape(value)}")
    return "|".join(parts)


_UNESCAPES = {"%25": "%", "%7C": "|", "%3D": "=", "%7B": "{", "%7D": "}"}
_ESCAPED = re.compile("|".join(_UNESCAPES))


def _unescape(value: str) -> str:
    # One pass, left to right: the inverse of _escape for any string it produced.
    return _ESCAPED.sub(lambda m: _UNESCAPES[m.group(0)], value)


def parse_key(key: str) -> tuple[str, dict[str, str]]:
    """Split a :func:`budget_key` back into its policy id and ``group_by`` values.

    Args:
        key: a budget key, for example ``acme-daily|api_key=k1``.

    Returns:
        The policy id and ``{field: value}`` in key order, both unescaped.
    """
    head, *parts = key.split("|")
    fields: dict[str, str] = {}
    for part in parts:
        name, _, value = part.partition("=")
        fields[_unescape(name)] = _unescape(value)
    return _unescape(head), fields


def targets(policies: Iterable[Policy], subject: SubjectView) -> list[BudgetTarget]:
    """Return every policy matching ``subject`` with its budget key, sorted by policy id.

    Args:
        policies: the policies in force.
        subject: the subject the request is for.

    Returns:
        The budget targets, one per matching policy.

    Raises:
        MissingGroupByField: a matching policy groups by a field the subject lacks.
    """
    chosen = sorted((p for p in policies if matches(p, subject)), key=lambda p: p.id)
    return [BudgetTarget(policy, budget_key(policy, subject)) for policy in chosen]


def is_exact(pattern: str) -> bool:
    """Whether a ``match`` value selects one value only (it holds no glob character)."""
    return GLOB_CHARS.isdisjoint(pattern)


def _anchor(policy: Policy) -> tuple[str, str] | None:
    """The exact ``match`` entry a policy is indexed under (``None``: none, it is scanned)."""
    exact = {field: value for field, value in policy.match.items() if is_exact(value)}
    for field in (*_INDEX_ORDER, *sorted(exact)):
        if field in exact:
            return field, exact[field]
    return None


class PolicyIndex:
    """The policies in force, looked up by their exact ``match`` fields.

    Each policy is filed under one exact ``match`` entry (field, value); a policy whose
    ``match`` is ``{}`` or holds only globs goes to a short list checked for every subject.
    A lookup reads one subject value per indexed field, takes the policies filed under it,
    and checks their remaining ``match`` entries: the work follows the policies that can
    match, not all of them (10,000 per-tenant policies cost one dict lookup). Immutable:
    build a new index when the policies change.

    Args:
        policies: the policies in force (ids unique).
    """

    def __init__(self, policies: Iterable[Policy]) -> None:
        self.policies: tuple[Policy, ...] = tuple(sorted(policies, key=lambda p: p.id))
        self._by_field: dict[str, dict[str, list[Policy]]] = {}
        self._scan: list[Policy] = []
        for policy in self.policies:
            anchor = _anchor(policy)
            if anchor is None:
                self._scan.append(policy)
            else:
                field, value = anchor
                self._by_field.setdefault(field, {}).setdefault(value, []).append(policy)

    def matching(self, subject: SubjectView) -> list[Policy]:
        """The policies whose ``match`` selects ``subject``, sorted by policy id."""
        found = [p for p in self._scan if matches(p, subject)]
        for field, filed in self._by_field.items():
            value = subject.value(field)
            if value is not None and value in filed:
                found += [p for p in filed[value] if matches(p, subject)]
        if len(found) > 1:
            found.sort(key=lambda p: p.id)
        return found

    def targets(self, subject: SubjectView) -> list[BudgetTarget]:
        """Equal to ``targets(index.policies, subject)``, found through the index.

        Raises:
            MissingGroupByField: a matching policy groups by a field the subject lacks.
        """
        return [BudgetTarget(p, budget_key(p, subject)) for p in self.matching(subject)]
