"""Per-model token prices for ``cost_usd`` budgets, and the exact cost of usage.

A catalog file (YAML or JSON) looks like::

    list_prices:
      claude-opus-*:    {input_per_mtok_micros: 15000000, output_per_mtok_micros: 75000000,
                         cached_input_per_mtok_micros: 1500000}
      claude-haiku-4:   {input_per_mtok_micros: 1000000, output_per_mtok_micros: 5000000}
    overrides:            # contract prices: always beat list prices
      claude-opus-4:    {input_per_mtok_micros: 12000000, output_per_mtok_micros: 60000000}
    default:              # only for policies with ``unpriced: charge_default``
      {input_per_mtok_micros: 20000000, output_per_mtok_micros: 100000000}

Rates are integer micro-USD (1 USD = 1,000,000) per million tokens, so $15/MTok is
``15000000`` and a cost is exact integer arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spendgate.schemas.events import SignedUsage, Usage
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.types import Amount, ModelPattern

_GLOB_CHARS = frozenset("*?[")
_PER_MTOK = 1_000_000


class ModelPrice(BaseModel):
    """One model's rates in integer micro-USD per million tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input_per_mtok_micros: Amount
    output_per_mtok_micros: Amount
    #: Rate for cached input tokens; ``None`` means the input rate.
    cached_input_per_mtok_micros: Amount | None = None

    @property
    def cached_rate_micros(self) -> int:
        """The cached-input rate in effect: its own rate, else the input rate."""
        if self.cached_input_per_mtok_micros is None:
            return self.input_per_mtok_micros
        return self.cached_input_per_mtok_micros


def _lookup(table: Mapping[str, ModelPrice], model: str) -> ModelPrice | None:
    exact = table.get(model)
    if exact is not None:
        return exact
    globs = [k for k in table if _GLOB_CHARS.intersection(k) and fnmatchcase(model, k)]
    if not globs:
        return None
    # Longest glob is the most specific; ties break on the key so the answer is stable.
    return table[min(globs, key=lambda k: (-len(k), k))]


class PriceCatalog(BaseModel):
    """List prices, contract overrides and an optional default rate.

    Keys are model names or globs (``claude-opus-*``, matched case-sensitively).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    list_prices: dict[ModelPattern, ModelPrice] = Field(default_factory=dict)
    overrides: dict[ModelPattern, ModelPrice] = Field(default_factory=dict)
    default: ModelPrice | None = None

    def price_of(self, model: str) -> ModelPrice | None:
        """Find the price of ``model``; the catalog ``default`` is never returned.

        Lookup order: ``overrides`` (exact key, then the longest matching glob), then
        ``list_prices`` the same way. A contract override therefore beats a list price
        even when the list key is more specific.

        Args:
            model: a concrete model name.

        Returns:
            The price, or ``None`` when neither table covers the model.
        """
        found = _lookup(self.overrides, model)
        return found if found is not None else _lookup(self.list_prices, model)


def cost_micros(price: ModelPrice, usage: Usage | SignedUsage) -> int:
    """Return the cost of ``usage`` at ``price`` in micro-USD, rounded up.

    ``input_tokens`` and ``cached_input_tokens`` are disjoint counts: input tokens
    exclude cached ones, which are charged at the cached rate. The policy setting
    ``count_cached_input`` affects token units only; cost always charges cached tokens.
    The result is ``ceil((input*in + cached*cached + output*out) / 1_000_000)`` in exact
    integer math, so a budget never under-counts (for a negative correction the ceiling
    rounds toward zero: a refund is never larger than exact).

    Args:
        price: the model's rates.
        usage: token counts (signed for corrections).

    Returns:
        The cost in integer micro-USD.
    """
    scaled = (
        usage.input_tokens * price.input_per_mtok_micros
        + usage.cached_input_tokens * price.cached_rate_micros
        + usage.output_tokens * price.output_per_mtok_micros
    )
    return -(-scaled // _PER_MTOK)


def _where(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def load_catalog(path: Path) -> PriceCatalog:
    """Read and validate a price catalog from a YAML or JSON file.

    ``.json`` files are parsed as JSON, anything else as YAML.

    Args:
        path: the catalog file.

    Returns:
        The validated catalog.

    Raises:
        ConfigurationError: the file cannot be read or parsed, or a field is invalid;
            the message names the file and every invalid field, such as
            ``overrides.claude-opus-4.input_per_mtok_micros``.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{path}: cannot read price catalog: {exc}") from exc
    try:
        raw: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"{path}: price catalog is not valid YAML/JSON: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigurationError(
            f"{path}: a price catalog is a mapping with list_prices, overrides, default"
        )
    try:
        return PriceCatalog.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigurationError(f"{path}: price catalog field {problems}") from exc
