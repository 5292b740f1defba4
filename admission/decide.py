"""Admission decisions without I/O: plans from indexed policies, cap terms, answers.

Everything here is a function of its arguments (policies, the subject, the estimate, what
the admit script returned, the in-process ledger): no Redis, no Kafka, no clock unless
given, so it is unit-tested without services. The routes (:mod:`admission.app`,
:mod:`admission.admit`) call it around one store call (:mod:`admission.store`).

Decisions (``POST /v1/admit``), over every policy matching the subject, in one Lua script:

* every key fits: ``allow``; only ``observe`` policies exceeded: ``observe_reject`` (200,
  everything reserved, ``violated`` and ``retry_after_seconds`` say what would have
  happened);
* an enforce policy with ``on_exceed: reject`` exceeded (or a cap/downgrade that cannot
  help): ``reject`` (429), nothing reserved anywhere;
* only ``cap`` policies exceeded: reserve with the largest output that fits every key,
  answered as ``max_output_tokens`` (see :func:`cap_terms` for each unit);
* a ``downgrade`` or ``route`` policy exceeded (and no reject): the same request with the
  model replaced by ``downgrade_to`` (or the pool by ``route_to``) is checked against the
  policies matching that subject; alternatives are tried in order, never chained;
* a ``delay`` policy exceeded: the script refuses; :mod:`admission.delay` holds the request
  and decides again when it fits (:func:`admission.delay.waitable_ms` says when it may);
* a policy's ``burst``: its token bucket refuses beside the window (same ``on_exceed``).

Redis unreachable, or a window it cannot vouch for: the strictest failure mode among the
keys concerned wins (closed > degraded > open); see :func:`fallback_answer`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from spendgate.admission.fallback import DegradedLedger, strictest
from spendgate.admission.scripts.admit import AdmitResult, KeyState, TargetTemplate
from spendgate.admission.scripts.codes import FAILURE_MODES, ON_EXCEED, Outcome, State
from spendgate.schemas.burst import BurstSpec, full_after_ms
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.exceptions import MissingGroupByField, UnitError
from spendgate.schemas.matching import BudgetTarget, PolicyIndex, budget_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.shards import tenant_scoped
from spendgate.schemas.types import MAX_AMOUNT
from spendgate.schemas.units import amount

__all__ = [
    "AdmitResult",
    "Answer",
    "CapTerms",
    "Charge",
    "FallbackAnswer",
    "KeyState",
    "Outcome",
    "Plan",
    "PlanKind",
    "Planner",
    "PolicyTerms",
    "State",
    "UnvouchedKeys",
    "alternative_of",
    "answer_of",
    "build_plans",
    "cap_terms",
    "fallback_answer",
    "ratelimit_headers",
    "statuses",
    "unvouched_of",
    "worst",
]

logger = logging.getLogger(__name__)

#: Printable ASCII kept as is in the ``Spendgate-Model`` header; the rest is %-encoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


@dataclass(frozen=True, slots=True)
class CapTerms:
    """How a key's amount depends on the output tokens ``o``: ``ceil((s + o*r) / d)``.

    ``r == 0`` means capping output cannot lower this key's amount.
    """

    s: int = 0
    r: int = 0
    d: int = 1


@dataclass(frozen=True, slots=True)
class PolicyTerms:
    """What one policy brings to every request, computed once per policy version."""

    policy: Policy
    window_ms: int
    window_s: int
    reservation_ttl_ms: int
    #: ``mode: enforce`` and ``failure`` not ``open``: an unvouched window blocks.
    enforce: bool
    tenant_scoped: bool
    #: The policy's part of the admit script's arguments.
    template: TargetTemplate
    #: The policy's token bucket, if any.
    burst: BurstSpec | None = None
    #: ``on_exceed: delay`` (enforce): the longest a request is held (0: never held).
    delay_ms: int = 0

    @classmethod
    def of(cls, policy: Policy) -> PolicyTerms:
        """Parse the policy's durations once and encode its script arguments."""
        window_ms = policy.window_ms
        ttl_ms = policy.reservation_ttl_ms
        burst = policy.burst.spec() if policy.burst is not None else None
        return cls(
            policy=policy,
            window_ms=window_ms,
            window_s=window_ms // 1000,
            reservation_ttl_ms=ttl_ms,
            enforce=policy.mode == "enforce",
            tenant_scoped=tenant_scoped(policy),
            template=TargetTemplate.of(
                limit=policy.limit,
                window_ms=window_ms,
                bucket_ms=policy.bucket_ms,
                boundary=policy.boundary,
                reservation_ttl_ms=ttl_ms,
                observe=policy.mode == "observe",
                on_exceed=ON_EXCEED[policy.on_exceed],
                failure=FAILURE_MODES[policy.failure],
                burst=burst.encode() if burst is not None else "",
            ),
            burst=burst,
            delay_ms=(
                policy.max_delay_ms
                if policy.on_exceed == "delay" and policy.mode == "enforce"
                else 0
            ),
        )


@dataclass(frozen=True, slots=True)
class Charge:
    """One budget key to check, with the amount this request would hold on it.

    ``alt`` is the index (0-based, > 0) of the plan to try when this key refuses and
    its policy downgrades; 0 for none. ``terms``: the policy's precomputed terms (built
    from ``target.policy`` when absent).
    """

    target: BudgetTarget
    amount: int
    cap: CapTerms = CapTerms()
    alt: int = 0
    terms: PolicyTerms | None = field(default=None, compare=False)


#: What a plan is: the request as sent, or an alternative (model or pool replaced).
PlanKind = Literal["asked", "downgrade", "route"]
#: The subject field each alternative replaces, and the policy field naming the value.
_ALTERNATIVES: dict[str, tuple[PlanKind, str]] = {
    "downgrade": ("downgrade", "model"),
    "route": ("route", "pool"),
}


def alternative_of(policy: Policy) -> tuple[PlanKind, str, str] | None:
    """``(kind, subject field, value)`` of the alternative ``policy`` offers, or None."""
    found = _ALTERNATIVES.get(policy.on_exceed)
    if found is None or policy.mode != "enforce":
        return None
    kind, field_name = found
    value = policy.downgrade_to if kind == "downgrade" else policy.route_to
    return None if value is None else (kind, field_name, value)


@dataclass(frozen=True, slots=True)
class Plan:
    """The request for one subject: as sent (``asked``), or an alternative with the model
    (``downgrade``) or the pool (``route``) replaced."""

    subject: Subject
    charges: tuple[Charge, ...]
    kind: PlanKind = "asked"


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


def cap_terms(
    policy: Policy, estimate: Usage, prices: PriceCatalog | None, model: str | None
) -> CapTerms:
    """How a key's amount depends on the output tokens, for ``cap``.

    * ``output_tokens``: the output itself; ``total_tokens``: the input part of the
      estimate (cached input when the policy counts it) plus the output;
    * ``cost_usd`` priced from tokens: ``ceil((input cost + output * output rate) / 1e6)``
      in micro-USD at the model's (or default) rate, exactly as the stream processor
      prices the capped usage; an estimate carrying its own ``cost_usd_micros`` is fixed;
    * ``requests``, ``input_tokens``, ``gpu_seconds``: capping output cannot lower them,
      so a cap policy of such a unit that does not fit refuses like ``reject``.
    """
    match policy.unit:
        case "output_tokens":
            return CapTerms(0, 1, 1)
        case "total_tokens":
            cached = estimate.cached_input_tokens if policy.count_cached_input else 0
            return CapTerms(estimate.input_tokens + cached, 1, 1)
        case "cost_usd" if estimate.cost_usd_micros is None:
            price = prices.price_of(model) if prices is not None and model is not None else None
            if price is None and policy.unpriced == "charge_default" and prices is not None:
                price = prices.default
            if price is None or price.output_per_mtok_micros == 0:
                return CapTerms()
            fixed = (
                estimate.input_tokens * price.input_per_mtok_micros
                + estimate.cached_input_tokens * price.cached_rate_micros
            )
            rate = price.output_per_mtok_micros
            # The Lua side works in doubles: beyond 2**53 it could not be exact.
            if fixed + estimate.output_tokens * rate > MAX_AMOUNT:
                return CapTerms()
            return CapTerms(fixed, rate, 1_000_000)
        case _:
            return CapTerms()


class Planner:
    """The policies of one version, indexed by their exact ``match`` fields, with each
    policy's terms precomputed: a plan costs a dict lookup per indexed field and work per
    *matching* policy, however many policies are in force.

    Args:
        policies: the policies in force.
        prices: the price catalog for ``cost_usd`` policies.
    """

    def __init__(self, policies: Sequence[Policy], prices: PriceCatalog | None) -> None:
        self.policies = policies
        self.prices = prices
        self.index = PolicyIndex(policies)
        self.terms = {p.id: PolicyTerms.of(p) for p in self.index.policies}
        #: Whether any policy in force may hold a request (``on_exceed: delay``).
        self.any_delay = any(t.delay_ms > 0 for t in self.terms.values())
        #: Whether any policy scales estimates after an overage (``overage: cap_next``).
        self.any_cap_next = any(p.overage == "cap_next" for p in self.index.policies)

    def charges(self, subject: Subject, estimate: Usage) -> list[Charge]:
        """Every matching policy's key and amount for ``subject`` (sorted by policy id).

        Raises:
            MissingGroupByField: a matching policy groups by a field the subject lacks.
            UnitError: the estimate cannot be counted in a matching policy's unit.
        """
        prices, model, terms = self.prices, subject.model, self.terms
        out = []
        for policy in self.index.matching(subject):
            # Every key's terms, not only cap policies': a capped output lowers the
            # amount held on every key whose unit depends on it.
            cap = cap_terms(policy, estimate, prices, model)
            out.append(
                Charge(
                    BudgetTarget(policy, budget_key(policy, subject)),
                    amount(policy, estimate, prices, model=model),
                    cap,
                    0,
                    terms[policy.id],
                )
            )
        return out

    def plans(self, subject: Subject, estimate: Usage) -> list[Plan]:
        """Plan 0 is the request as sent; one more plan per distinct alternative (a
        downgrade's model or a route's pool), in the order of the policies offering them.

        Downgrade and route are one mechanism: an alternative is the same request for
        the subject with one field replaced, checked against the policies matching
        *that* subject, in the same script, tried in order when plan 0 is refused only
        by policies offering alternatives, never chained.

        Raises:
            BadRequest: a matching policy groups by a field the subject lacks.
            Unprocessable: the estimate cannot be counted in a matching policy's unit.
        """
        from spendgate.admission.exceptions import BadRequest, Unprocessable

        try:
            first = self.charges(subject, estimate)
        except MissingGroupByField as exc:
            raise BadRequest(str(exc), f"subject.{exc.field}") from exc
        except UnitError as exc:
            raise Unprocessable(str(exc), "estimate") from exc
        plans: list[Plan] = []
        alt_of: dict[tuple[str, str], int] = {}
        charges = []
        for charge in first:
            found = alternative_of(charge.target.policy)
            if found is not None and subject.value(found[1]) != found[2]:
                kind, name, value = found
                if (name, value) not in alt_of:
                    alt_subject = subject.model_copy(update={name: value})
                    try:
                        alt = self.charges(alt_subject, estimate)
                    except (MissingGroupByField, UnitError) as exc:
                        logger.debug("no %s to %s: %s", kind, value, exc)
                        alt_of[name, value] = 0
                    else:
                        alt_of[name, value] = len(plans) + 1
                        plans.append(Plan(alt_subject, tuple(alt), kind))
                charge = dataclasses.replace(charge, alt=alt_of[name, value])
            charges.append(charge)
        return [Plan(subject, tuple(charges)), *plans]


def build_plans(
    policies: Sequence[Policy], subject: Subject, estimate: Usage, prices: PriceCatalog | None
) -> list[Plan]:
    """:meth:`Planner.plans` for a one-off list of policies (indexes them first)."""
    return Planner(policies, prices).plans(subject, estimate)


def _seconds(ms: int) -> int:
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
            "reset_after_seconds": _seconds(state.reset_after_ms),
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
                "window_seconds": _seconds(full_after_ms(spec, 0)),
                "reset_after_seconds": _seconds(full_ms),
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


def _decision_body(
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
    # ``schemas.decisions.Decision`` dumped with exclude_none, field for field.
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


def _answer(body: dict[str, Any], status: int, extra: dict[str, str] | None = None) -> Answer:
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
        else max(1, _seconds(result.retry_after_ms))
    )
    label: str = result.outcome
    route_to = None
    if result.outcome != "reject" and result.plan > 0:
        label = plan.kind if plan is not None and plan.kind != "asked" else "downgrade"
        if plan is not None and plan.kind == "route":
            route_to = plan.subject.pool
    body = _decision_body(
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
    return _answer(body, 429 if result.outcome == "reject" else 200)


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


@dataclass(frozen=True, slots=True)
class FallbackAnswer:
    """What to do without Redis's decision.

    ``mode`` ``closed``: refuse (``closed`` names the policies); otherwise ``answer`` is
    the answer, and when it admits, ``ttl_ms`` is the reservation's TTL (the caller makes
    the reservation id, remembers it and publishes its reserve event).
    """

    mode: Literal["closed", "degraded", "open"]
    closed: tuple[str, ...] = ()
    answer: Answer | None = None
    admitted: bool = False
    ttl_ms: int = 0


def fallback_answer(
    ledger: DegradedLedger,
    charges: Sequence[Charge],
    model: str | None,
    now_ms: int,
    reservation_id: str,
    default_ttl_ms: int,
) -> FallbackAnswer:
    """Decide without Redis, by the strictest failure mode of ``charges``' policies.

    ``degraded`` keys charge this process's own allowance in ``ledger`` (all or none).

    Args:
        ledger: this process's counters while Redis cannot decide.
        charges: the keys concerned (a plan's, or only those Redis cannot vouch for).
        model: the subject's model (as sent).
        now_ms: this process's clock.
        reservation_id: the id an admitted reservation gets.
        default_ttl_ms: the TTL when no policy gives one.
    """
    policies = [c.target.policy for c in charges]
    mode = strictest(policies)
    if mode == "closed":
        closed = tuple(p.id for p in policies if p.mode == "enforce" and p.failure == "closed")
        return FallbackAnswer("closed", closed)
    budgets: list[dict[str, Any]] = []
    extra: dict[str, str] = {"Spendgate-Fallback": mode}
    if mode == "degraded":
        held = [
            c
            for c in charges
            if c.target.policy.mode == "enforce" and c.target.policy.failure == "degraded"
        ]
        over = ledger.try_charge([(c.target.policy, c.target.key, c.amount) for c in held], now_ms)
        for c in held:
            p = c.target.policy
            allowance = ledger.allowance(p)
            spent = ledger.spent(p, c.target.key, now_ms)
            budgets.append(
                {
                    "policy": p.id,
                    "key": c.target.key,
                    "unit": p.unit,
                    "limit": max(1, allowance),
                    "used": 0,
                    "reserved": spent,
                    "remaining": max(0, allowance - spent),
                    "window_seconds": p.window_ms // 1000,
                    "reset_after_seconds": _seconds(ledger.window_left_ms(p, now_ms)),
                }
            )
        if over:
            refusing = [held[i].target.policy for i in over]
            wait = max(ledger.window_left_ms(p, now_ms) for p in refusing)
            never = any(held[i].amount > ledger.allowance(held[i].target.policy) for i in over)
            body = _decision_body(
                "reject",
                violated=[p.id for p in refusing],
                retry_after_seconds=None if never else max(1, _seconds(wait)),
                never_fits=never,
                budgets=budgets,
                model=model,
            )
            return FallbackAnswer(mode, answer=_answer(body, 429, extra))
    ttl_ms = max((p.reservation_ttl_ms for p in policies), default=default_ttl_ms)
    body = _decision_body("allow", reservation_id=reservation_id, model=model, budgets=budgets)
    return FallbackAnswer(mode, answer=_answer(body, 200, extra), admitted=True, ttl_ms=ttl_ms)
