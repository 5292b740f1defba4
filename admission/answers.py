"""Admit answers without I/O: the body, status and headers of a decision.

:func:`answer_of` turns what the admit script returned into the answer sent; the fallback
path (``admission.fallback``) builds its own from :func:`decision_body` and
:func:`make_answer`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

from spendgate.admission.plans import Charge, Plan, PolicyTerms
from spendgate.admission.scripts.admit import AdmitResult, KeyState
from spendgate.schemas.burst import full_after_ms
from spendgate.schemas.events import Subject

__all__ = [
    "Answer",
    "UnvouchedKeys",
    "answer_of",
    "decision_body",
    "make_answer",
    "ratelimit_headers",
    "seconds",
    "statuses",
    "unvouched_of",
    "worst",
]

#: Printable ASCII kept as is in the ``Spendgate-Model`` header; the rest is %-encoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


@dataclass(frozen=True, slots=True)
class Answer:
    """An admit answer ready to send: status, JSON body (plain values), headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]

    @property
    def decision(self) -> str:
        """The decision label (``allow``, ``reject``, ...)."""
        return str(self.body["decision"])


def seconds(ms: int) -> int:
    """Whole seconds, rounded up."""
    return math.ceil(ms / 1000)


def _terms(charge: Charge) -> PolicyTerms:
    return charge.terms if charge.terms is not None else PolicyTerms.of(charge.target.policy)


def statuses(
    charges: Sequence[Charge],
    keys: Sequence[KeyState],
    exhausts_in_s: Sequence[int | None] | None = None,
) -> list[dict[str, Any]]:
    """The ``budgets[]`` items (``schemas.decisions.BudgetStatus`` as JSON values).

    ``exhausts_in_s``: each key's forecast (``GET /v1/budgets``), put in every item (null
    included) when given.
    """
    out = []
    for i, (charge, state) in enumerate(zip(charges, keys, strict=True)):
        p = charge.target.policy
        held = state.reserved + state.own
        item: dict[str, Any] = {
            "policy": p.id,
            "key": charge.target.key,
            "unit": p.unit,
            "limit": p.limit,
            "used": state.used,
            "reserved": held,
            "remaining": max(0, p.limit - state.used - held),
            "window_seconds": _terms(charge).window_s,
            "reset_after_seconds": seconds(state.reset_after_ms),
        }
        if exhausts_in_s is not None:
            item["exhausts_in_seconds"] = exhausts_in_s[i]
        if state.state != "vouched":
            item["state"] = state.state
        spec = _terms(charge).burst
        if spec is not None and state.burst is not None:
            tokens, full_ms = state.burst
            item["burst"] = {
                "capacity": spec.capacity,
                "remaining": tokens,
                "window_seconds": seconds(full_after_ms(spec, 0)),
                "reset_after_seconds": seconds(full_ms),
            }
        out.append(item)
    return out


def worst(states: Sequence[KeyState]) -> Literal["missing", "stale"] | None:
    """The worst state among ``states`` (None when every window is vouched for)."""
    seen = {s.state for s in states}
    return "missing" if "missing" in seen else "stale" if "stale" in seen else None


def ratelimit_headers(budgets: Sequence[Any]) -> dict[str, str]:
    """``RateLimit-Policy`` / ``RateLimit`` (IETF httpapi draft) for the tightest budget.

    Args:
        budgets: ``budgets[]`` items, as dicts or :class:`schemas.decisions.BudgetStatus`.
    """
    if not budgets:
        return {}
    items = [b if isinstance(b, dict) else b.model_dump() for b in budgets]
    # A token bucket competes as its own quota, named ``<policy>.burst``: its refill time
    # is what a client waits for when the bucket, not the window, is the tighter.
    items += [
        {**burst, "policy": f"{b['policy']}.burst", "limit": burst["capacity"]}
        for b in items
        if (burst := b.get("burst")) is not None
    ]
    tight = min(items, key=lambda b: (b["remaining"] / b["limit"], b["remaining"], b["policy"]))
    return {
        "RateLimit-Policy": f'"{tight["policy"]}";q={tight["limit"]};w={tight["window_seconds"]}',
        "RateLimit": f'"{tight["policy"]}";r={tight["remaining"]};t={tight["reset_after_seconds"]}',
    }


def decision_body(
    decision: str,
    *,
    reservation_id: str | None = None,
    model: str | None = None,
    route_to: str | None = None,
    max_output_tokens: int | None = None,
    violated: list[str] | None = None,
    retry_after_seconds: int | None = None,
    never_fits: bool = False,
    budgets: list[dict[str, Any]] | None = None,
    state: str | None = None,
) -> dict[str, Any]:
    """An answer's body: ``schemas.decisions.Decision`` dumped with exclude_none, field
    for field."""
    body: dict[str, Any] = {"decision": decision}
    if reservation_id is not None:
        body["reservation_id"] = reservation_id
    if model is not None:
        body["model"] = model
    if route_to is not None:
        body["route_to"] = route_to
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    body["violated"] = violated if violated is not None else []
    if retry_after_seconds is not None:
        body["retry_after_seconds"] = retry_after_seconds
    body["never_fits"] = never_fits
    body["budgets"] = budgets if budgets is not None else []
    if state is not None:
        body["state"] = state
    return body


def make_answer(body: dict[str, Any], status: int, extra: dict[str, str] | None = None) -> Answer:
    headers = ratelimit_headers(body["budgets"])
    if extra:
        headers.update(extra)
    headers["Spendgate-Decision"] = body["decision"]
    model = body.get("model")
    if model is not None:
        # Header values are Latin-1 on the wire: a model name outside it is sent
        # percent-encoded (RFC 3986 style); the body carries it as sent.
        headers["Spendgate-Model"] = quote(model, safe=_HEADER_SAFE)
    route_to = body.get("route_to")
    if route_to is not None:
        headers["Spendgate-Route"] = quote(route_to, safe=_HEADER_SAFE)
    retry = body.get("retry_after_seconds")
    if retry is not None and status == 429:
        headers["Retry-After"] = str(retry)
    return Answer(status, body, headers)


def answer_of(result: AdmitResult, plans: Sequence[Plan], subject: Subject) -> Answer:
    """The answer to a script result that decided (any outcome but ``unvouched``).

    Args:
        result: what the script returned.
        plans: the plans it was given.
        subject: the subject as sent.
    """
    plan = plans[result.plan] if result.plan < len(plans) else None
    if plan is None or len(plan.charges) != len(result.keys):
        # Replayed after the policies changed: the reservation stands, the per-key
        # view cannot be rebuilt.
        budgets: list[dict[str, Any]] = []
        violated: list[str] = []
        model = subject.model
    else:
        budgets = statuses(plan.charges, result.keys)
        violated = [
            c.target.policy.id for c, k in zip(plan.charges, result.keys, strict=True) if k.violated
        ]
        model = plan.subject.model
    retry_s = (
        None
        if result.never_fits or result.retry_after_ms is None
        else max(1, seconds(result.retry_after_ms))
    )
    label: str = result.outcome
    route_to = None
    if result.outcome != "reject" and result.plan > 0:
        label = plan.kind if plan is not None and plan.kind != "asked" else "downgrade"
        if plan is not None and plan.kind == "route":
            route_to = plan.subject.pool
    body = decision_body(
        label,
        reservation_id=None if result.outcome == "reject" else result.reservation_id,
        model=model,
        route_to=route_to,
        max_output_tokens=result.max_output_tokens,
        violated=violated,
        retry_after_seconds=retry_s,
        never_fits=result.never_fits,
        budgets=budgets,
        state=worst(result.keys),
    )
    return make_answer(body, 429 if result.outcome == "reject" else 200)


@dataclass(frozen=True, slots=True)
class UnvouchedKeys:
    """Why the script would not decide: the keys whose window is not vouched for and
    whose policy does not fail open."""

    blocking: tuple[Charge, ...]
    state: Literal["missing", "stale"]
    #: The policies among them that fail closed (sorted, unique); empty: degraded.
    closed: tuple[str, ...]
    why: str


def unvouched_of(plans: Sequence[Plan], result: AdmitResult) -> UnvouchedKeys:
    """Which keys made the script answer ``unvouched``, and what that means."""
    pairs = [
        (c, k)
        for c, k in zip(plans[result.plan].charges, result.keys, strict=True)
        if k.state != "vouched"
        and c.target.policy.mode == "enforce"
        and c.target.policy.failure != "open"
    ]
    state = worst([k for _, k in pairs]) or "missing"
    keys = ", ".join(c.target.key for c, _ in pairs)
    why = (
        f"budget state for {keys} is {state} in Redis ("
        + (
            "lost; the worker is restoring it"
            if state == "missing"
            else "its worker is dead or behind"
        )
        + ")"
    )
    closed = sorted({c.target.policy.id for c, _ in pairs if c.target.policy.failure == "closed"})
    return UnvouchedKeys(tuple(c for c, _ in pairs), state, tuple(closed), why)
