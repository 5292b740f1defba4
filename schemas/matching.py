"""Which policies apply to a subject, and the budget key each one counts under."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from schemas.events import Subject
from schemas.exceptions import MissingGroupByField
from schemas.policies import Policy


@dataclass(frozen=True, slots=True)
class BudgetTarget:
    """A policy applied to one subject: the counter to check and charge."""

    policy: Policy
    key: str


def matches(policy: Policy, subject: Subject) -> bool:
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


def budget_key(policy: Policy, subject: Subject) -> str:
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


def targets(policies: Iterable[Policy], subject: Subject) -> list[BudgetTarget]:
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
