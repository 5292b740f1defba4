"""Deriving each unit's amount from usage, prices and the policy's settings."""

from __future__ import annotations

from typing import Any

import pytest

from spendgate.schemas import (
    ModelPrice,
    Policy,
    PriceCatalog,
    SignedUsage,
    UnitError,
    UnpricedModel,
    Usage,
    amount,
)
from spendgate.schemas.types import MAX_AMOUNT

USAGE = Usage(requests=1, input_tokens=100, cached_input_tokens=40, output_tokens=7, gpu_ms=2500)
SONNET = ModelPrice(
    input_per_mtok_micros=3_000_000,
    output_per_mtok_micros=15_000_000,
    cached_input_per_mtok_micros=300_000,
)
FALLBACK = ModelPrice(input_per_mtok_micros=10_000_000, output_per_mtok_micros=10_000_000)
CATALOG = PriceCatalog(list_prices={"claude-sonnet-*": SONNET}, default=FALLBACK)


def policy(unit: str, **fields: Any) -> Policy:
    return Policy.model_validate({"id": "p", "unit": unit, "limit": 10**9, **fields})


class TestTokenAndCountUnits:
    @pytest.mark.parametrize(
        ("unit", "counted", "not_counted"),
        [
            ("requests", 1, 1),
            ("input_tokens", 140, 100),
            ("output_tokens", 7, 7),
            ("total_tokens", 147, 107),
            ("gpu_seconds", 2500, 2500),
            ("cost_usd", 417, 417),  # cost always charges cached tokens
        ],
    )
    def test_count_cached_input_on_and_off(self, unit: str, counted: int, not_counted: int) -> None:
        on, off = policy(unit), policy(unit, count_cached_input=False)
        assert amount(on, USAGE, CATALOG, model="claude-sonnet-4") == counted
        assert amount(off, USAGE, CATALOG, model="claude-sonnet-4") == not_counted

    def test_gpu_seconds_are_counted_in_milli_gpu_seconds(self) -> None:
        assert amount(policy("gpu_seconds"), Usage(gpu_ms=1)) == 1
        assert amount(policy("gpu_seconds"), Usage(gpu_ms=3_600_000)) == 3_600_000

    def test_corrections_are_signed(self) -> None:
        delta = SignedUsage(input_tokens=-5, cached_input_tokens=-2, output_tokens=3)
        assert amount(policy("total_tokens"), delta) == -4
        assert amount(policy("input_tokens", count_cached_input=False), delta) == -5

    def test_the_two_argument_call_still_works(self) -> None:
        assert amount(policy("requests"), USAGE) == 1

    def test_an_amount_too_large_for_a_counter_is_refused(self) -> None:
        huge = Usage(input_tokens=MAX_AMOUNT, output_tokens=1)
        with pytest.raises(UnitError, match="2\\*\\*53"):
            amount(policy("total_tokens"), huge)


class TestCost:
    def test_a_carried_cost_wins_over_the_catalog(self) -> None:
        usage = USAGE.model_copy(update={"cost_usd_micros": 99})
        assert amount(policy("cost_usd"), usage, CATALOG, model="claude-sonnet-4") == 99
        assert amount(policy("cost_usd"), usage) == 99

    def test_a_priced_model_is_charged_its_rate_rounded_up(self) -> None:
        # 100 * 3 + 40 * 0.3 + 7 * 15 = 417 micro-USD exactly.
        assert amount(policy("cost_usd"), USAGE, CATALOG, model="claude-sonnet-4") == 417
        # One more cached token adds 0.3 micro-USD: 417.3 is charged as 418.
        usage = USAGE.model_copy(update={"cached_input_tokens": 41})
        assert amount(policy("cost_usd"), usage, CATALOG, model="claude-sonnet-4") == 418

    @pytest.mark.parametrize("catalog", [CATALOG, None], ids=["unpriced", "no-catalog"])
    def test_reject_names_the_model(self, catalog: PriceCatalog | None) -> None:
        with pytest.raises(UnpricedModel, match="'gpt-9'") as info:
            amount(policy("cost_usd"), USAGE, catalog, model="gpt-9")
        assert isinstance(info.value, UnitError)
        assert (info.value.policy_id, info.value.model) == ("p", "gpt-9")

    def test_reject_without_a_model(self) -> None:
        with pytest.raises(UnpricedModel, match="no model"):
            amount(policy("cost_usd"), USAGE, CATALOG)

    def test_charge_default_uses_the_default_rate_only_for_unpriced_models(self) -> None:
        p = policy("cost_usd", unpriced="charge_default")
        assert amount(p, USAGE, CATALOG, model="gpt-9") == 1470  # 147 tokens at $10/MTok
        assert amount(p, USAGE, CATALOG) == 1470
        assert amount(p, USAGE, CATALOG, model="claude-sonnet-4") == 417

    def test_charge_default_without_a_default_still_refuses(self) -> None:
        p = policy("cost_usd", unpriced="charge_default")
        no_default = CATALOG.model_copy(update={"default": None})
        for catalog in (no_default, None):
            with pytest.raises(UnpricedModel, match="gpt-9"):
                amount(p, USAGE, catalog, model="gpt-9")

    def test_token_units_never_need_a_price(self) -> None:
        assert amount(policy("output_tokens"), USAGE, None, model="gpt-9") == 7
