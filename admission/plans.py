"""Plans of one admit request, without I/O: the matching policies' keys, amounts and cap terms.

A request is one or more :class:`Plan`: plan 0 the subject as sent, then one per distinct
alternative a ``downgrade`` or ``route`` policy offers. :class:`Planner` indexes the policies
in force once per version and builds them; each :class:`Charge` carries what the admit
script (and its twin, ``schemas.decision``) needs of a key.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from spendgate.admission.scripts.admit import TargetTemplate
from spendgate.admission.scripts.codes import FAILURE_MODES, ON_EXCEED
from spendgate.schemas.burst import BurstSpec
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.exceptions import MissingGroupByField, UnitError
from spendgate.schemas.matching import BudgetTarget, PolicyIndex, budget_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.shards import tenant_scoped
from spendgate.schemas.types import MAX_AMOUNT
from spendgate.schemas.units import amount

__all__ = [
    "CapTerms",
    "Charge",
    "Plan",
    "PlanKind",
    "Planner",
    "PolicyTerms",
    "alternative_of",
    "build_plans",
    "cap_terms",
]

logger = logging.getLogger(__name__)


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
