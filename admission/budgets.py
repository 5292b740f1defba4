"""``GET /v1/budgets``: every budget matching a subject, read without reserving anything."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from spendgate.admission.bodies import BudgetList
from spendgate.admission.decide import Plan, Planner, statuses
from spendgate.admission.exceptions import BadRequest
from spendgate.admission.store import BudgetStore
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.forecast import forecast
from spendgate.schemas.policies import Policy
from spendgate.schemas.types import SUBJECT_FIELDS
from spendgate.schemas.windows import WindowSpec

__all__ = ["read_budgets", "subject_of_query"]


def subject_of_query(items: Iterable[tuple[str, str]]) -> Subject:
    """The subject named by query parameters: subject fields, and ``labels.NAME=value``.

    Raises:
        BadRequest: an unknown parameter, or a value the subject refuses (names it).
    """
    fields: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for name, value in items:
        if name in SUBJECT_FIELDS:
            fields[name] = value
        elif name.startswith("labels.") and len(name) > len("labels."):
            labels[name.removeprefix("labels.")] = value
        else:
            raise BadRequest(f"unknown query parameter {name!r}", name)
    try:
        return Subject.model_validate({**fields, "labels": labels})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"{where}: {first['msg']}", where) from exc


async def read_budgets(
    store: BudgetStore, planner: Callable[[Sequence[Policy]], Planner], subject: Subject
) -> BudgetList:
    """Every budget matching ``subject``: what each holds and when, at this pace, it runs out.

    Args:
        store: Redis access (one read-only admit script call, one read of the buckets).
        planner: the planner of the policies in force (``AdmitService.planner``).
        subject: whose budgets.
    """
    # A zero estimate with a zero cost: reading never needs a price.
    plan = planner(await store.policies()).plans(subject, Usage(cost_usd_micros=0))[0]
    plans = [Plan(subject, tuple(dataclasses.replace(c, alt=0) for c in plan.charges))]
    result = await store.admit("", uuid.uuid4().hex, plans, 0, read_only=True)
    charges = plans[0].charges
    held = await store.buckets(charges)
    ahead = [
        forecast(
            WindowSpec(p.window_ms, p.bucket_ms, p.boundary), b, result.now_ms, limit=p.limit
        ).exhausts_in_seconds
        for p, b in zip((c.target.policy for c in charges), held, strict=True)
    ]
    return BudgetList.model_validate({"budgets": statuses(charges, result.keys, ahead)})
