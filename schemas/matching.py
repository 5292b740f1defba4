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
    """True when every ``match`` entry selects the subject (exact value or glob)."""
    for field, pattern in policy.match.items():
        value = subject.value(field)
        if value is None or not fnmatchcase(value, pattern):
            return False
    return True


def _escape(value: str) -> str:
    # Percent-encode the key's own separators so no subject value can address another key.
    return (
        value.replace("%", "%25")
        .replace("|", "%7C")
        .replace("=", "%3D")
        .replace("{", "%7B")
        .replace("}", "%7D")
    )


def budget_key(policy: Policy, subject: Subject) -> str:
    """The readable, collision-free key ``policy|field=value|...`` of ``group_by`` values.

    Raises:
        MissingGroupByField: the subject lacks a field the policy groups by.
    """
    parts = [_escape(policy.id)]
    for field in policy.group_by:
        value = subject.value(field)
        if value is None:
            raise MissingGroupByField(policy.id, field)
        parts.append(f"{field}={_escape(value)}")
    return "|".join(parts)


def targets(policies: Iterable[Policy], subject: Subject) -> list[BudgetTarget]:
    """Every policy matching ``subject`` with its budget key, sorted by policy id.

    Raises:
        MissingGroupByField: a matching policy groups by a field the subject lacks.
    """
    chosen = sorted((p for p in policies if matches(p, subject)), key=lambda p: p.id)
    return [BudgetTarget(policy, budget_key(policy, subject)) for policy in chosen]
