"""The fold's rules: the policies in force and the prices, prepared once per policy version."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.matching import PolicyIndex
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.shards import tenant_scoped
from spendgate.streams.ledger import PolicyTerms

__all__ = ["Plan", "Rules"]


@dataclass(frozen=True, slots=True)
class Plan:
    """One policy's figures, parsed once per policy version: its record terms (the one
    builder of its keyed records) and whether the usage fold applies its keys itself."""

    policy: Policy
    terms: PolicyTerms
    local: bool


class Rules:
    """The policies in force and the prices, prepared once per policy version.

    Args:
        policies: the policies in force.
        prices: the price catalog (``cost_usd`` policies), if any.
        local: which policies' keys ``streams.fold.fold_usage`` applies itself (default
            :func:`tenant_scoped`; ``replay`` passes ``lambda p: True``: no hop).
        key_ids: the secret subject fields' key ids: a record whose subject carries a raw
            value is matched and keyed by its id, and dead-lettered with it (none: values
            are taken as they arrive). The policies must already be in key-id form
            (``KeyIds.policy``, as the policy book loads them).
    """

    def __init__(
        self,
        policies: Iterable[Policy],
        prices: PriceCatalog | None,
        *,
        local: Callable[[Policy], bool] = tenant_scoped,
        key_ids: KeyIds | None = None,
    ) -> None:
        self.key_ids = key_ids
        self.index = PolicyIndex(policies)
        self.prices = prices
        self._plans = {p.id: Plan(p, PolicyTerms.of(p), local(p)) for p in self.index.policies}

    def plan(self, policy: Policy) -> Plan:
        """The prepared figures of one of these policies."""
        return self._plans[policy.id]
