"""Turn usage into the amount a policy's unit counts."""

from __future__ import annotations

from spendgate.schemas.events import SignedUsage, Usage
from spendgate.schemas.exceptions import UnitError, UnpricedModel
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog, cost_micros
from spendgate.schemas.types import MAX_AMOUNT


def _cost(
    policy: Policy, usage: Usage | SignedUsage, prices: PriceCatalog | None, model: str | None
) -> int:
    if usage.cost_usd_micros is not None:
        return usage.cost_usd_micros
    price = prices.price_of(model) if prices is not None and model is not None else None
    if price is None and policy.unpriced == "charge_default" and prices is not None:
        price = prices.default
    if price is None:
        raise UnpricedModel(policy.id, model)
    return cost_micros(price, usage)


def amount(
    policy: Policy,
    usage: Usage | SignedUsage,
    prices: PriceCatalog | None = None,
    *,
    model: str | None = None,
) -> int:
    """Return the amount of ``policy.unit`` in ``usage`` (signed for corrections).

    Token units: ``input_tokens`` and ``cached_input_tokens`` are disjoint counts;
    cached tokens count toward ``input_tokens`` and ``total_tokens`` only when the policy's
    ``count_cached_input`` is true. ``gpu_seconds`` is counted in milli-GPU-seconds, which
    is ``gpu_ms``. ``cost_usd`` is micro-USD: the usage's own ``cost_usd_micros`` when it
    carries one, else the cost of its tokens at the catalog price of ``model`` (see
    :func:`schemas.prices.cost_micros`), else, with ``unpriced: charge_default``, at the
    catalog default.

    Args:
        policy: the policy whose unit is counted.
        usage: what a request used or is estimated to use.
        prices: the price catalog, needed for ``cost_usd`` when usage carries no cost.
        model: the subject's model, to look up its price.

    Returns:
        The integer amount.

    Raises:
        UnpricedModel: (a ``UnitError``) ``cost_usd`` is asked for, the usage has no cost
            and no price applies; the message names the model.
        UnitError: the amount exceeds 2**53-1, the largest a counter holds exactly.
    """
    cached = usage.cached_input_tokens if policy.count_cached_input else 0
    match policy.unit:
        case "requests":
            result = usage.requests
        case "input_tokens":
            result = usage.input_tokens + cached
        case "output_tokens":
            result = usage.output_tokens
        case "total_tokens":
            result = usage.input_tokens + cached + usage.output_tokens
        case "gpu_seconds":
            result = usage.gpu_ms
        case "cost_usd":
            result = _cost(policy, usage, prices, model)
    if abs(result) > MAX_AMOUNT:
        raise UnitError(f"policy {policy.id!r}: {policy.unit} amount {result} exceeds 2**53-1")
    return result
