"""Price catalog lookup, exact rounded-up costs, and loading catalog files."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas import (
    ConfigurationError,
    ModelPrice,
    PriceCatalog,
    SignedUsage,
    Usage,
    cost_micros,
    load_catalog,
)
from spendgate.schemas.types import MAX_AMOUNT


def price(inp: int, out: int, cached: int | None = None) -> ModelPrice:
    return ModelPrice(
        input_per_mtok_micros=inp, output_per_mtok_micros=out, cached_input_per_mtok_micros=cached
    )


OPUS_LIST = price(15_000_000, 75_000_000, 1_500_000)
OPUS_CONTRACT = price(12_000_000, 60_000_000)
ANY_CLAUDE = price(1, 2)


class TestLookup:
    def test_exact_key_beats_any_glob(self) -> None:
        catalog = PriceCatalog(
            list_prices={"claude-opus-*": OPUS_LIST, "claude-opus-4": ANY_CLAUDE}
        )
        assert catalog.price_of("claude-opus-4") == ANY_CLAUDE
        assert catalog.price_of("claude-opus-5") == OPUS_LIST

    def test_the_longest_matching_glob_wins_and_ties_break_on_the_key(self) -> None:
        short, long_, tie_a, tie_b = price(1, 1), price(2, 2), price(3, 3), price(4, 4)
        catalog = PriceCatalog(
            list_prices={
                "claude-*": short,
                "claude-opus-*": long_,
                "claude-opus-*x": tie_b,
                "claude-*pus-4x": tie_a,
            }
        )
        assert catalog.price_of("claude-opus-4") == long_
        assert catalog.price_of("claude-haiku-3") == short
        # Two 14-character globs match: the smaller key wins, whatever the dict order.
        assert catalog.price_of("claude-opus-4x") == tie_a

    def test_globs_are_case_sensitive_and_unknown_models_have_no_price(self) -> None:
        catalog = PriceCatalog(list_prices={"claude-*": OPUS_LIST}, default=ANY_CLAUDE)
        assert catalog.price_of("Claude-3") is None
        assert catalog.price_of("gpt-4o") is None  # the default is never a model's price

    def test_overrides_beat_list_prices_even_a_more_specific_list_key(self) -> None:
        catalog = PriceCatalog(
            list_prices={"claude-opus-4": OPUS_LIST, "gpt-4o": ANY_CLAUDE},
            overrides={"claude-opus-*": OPUS_CONTRACT},
        )
        assert catalog.price_of("claude-opus-4") == OPUS_CONTRACT
        assert catalog.price_of("gpt-4o") == ANY_CLAUDE

    def test_the_cached_rate_defaults_to_the_input_rate(self) -> None:
        assert price(7, 9).cached_rate_micros == 7
        assert price(7, 9, 1).cached_rate_micros == 1
        assert price(7, 9, 0).cached_rate_micros == 0


class TestCost:
    @pytest.mark.parametrize(
        ("usage", "expected"),
        [
            (Usage(), 0),
            (Usage(input_tokens=1), 15),
            (Usage(output_tokens=1_000_000), 75_000_000),
            (Usage(cached_input_tokens=1), 2),  # 1.5 micro-USD rounds up
            (Usage(input_tokens=1000, cached_input_tokens=2000, output_tokens=500), 55_500),
            (Usage(requests=9, gpu_ms=9), 0),  # only tokens are priced
        ],
    )
    def test_examples(self, usage: Usage, expected: int) -> None:
        assert cost_micros(OPUS_LIST, usage) == expected

    def test_cached_tokens_cost_the_input_rate_without_a_cached_rate(self) -> None:
        assert cost_micros(price(3_000_000, 0), Usage(cached_input_tokens=10)) == 30

    def test_a_fraction_of_a_micro_dollar_is_charged_as_one(self) -> None:
        assert cost_micros(price(1, 1), Usage(input_tokens=1)) == 1

    def test_a_negative_correction_rounds_toward_zero(self) -> None:
        assert cost_micros(price(1, 1), SignedUsage(input_tokens=-1)) == 0
        assert cost_micros(OPUS_LIST, SignedUsage(cached_input_tokens=-1)) == -1

    @given(
        rates=st.tuples(*[st.integers(0, 10**9)] * 3),
        tokens=st.tuples(*[st.integers(-(10**7), 10**7)] * 3),
    )
    def test_cost_is_the_exact_cost_rounded_up(
        self, rates: tuple[int, int, int], tokens: tuple[int, int, int]
    ) -> None:
        p = price(rates[0], rates[1], rates[2])
        usage = SignedUsage(
            input_tokens=tokens[0], output_tokens=tokens[1], cached_input_tokens=tokens[2]
        )
        exact = Fraction(tokens[0] * rates[0] + tokens[1] * rates[1] + tokens[2] * rates[2])
        charged = cost_micros(p, usage) * 1_000_000
        assert exact <= charged < exact + 1_000_000

    def test_huge_counts_stay_exact(self) -> None:
        usage = Usage(input_tokens=MAX_AMOUNT, output_tokens=MAX_AMOUNT)
        expected = -(-(MAX_AMOUNT * 15_000_000 + MAX_AMOUNT * 75_000_000) // 1_000_000)
        assert cost_micros(OPUS_LIST, usage) == expected


class TestLoadCatalog:
    def test_yaml(self, tmp_path: Path) -> None:
        path = tmp_path / "prices.yaml"
        path.write_text(
            "list_prices:\n"
            "  claude-opus-*: {input_per_mtok_micros: 15000000, output_per_mtok_micros: 75000000}\n"
            "overrides:\n"
            "  claude-opus-4: {input_per_mtok_micros: 1, output_per_mtok_micros: 2}\n"
            "default: {input_per_mtok_micros: 3, output_per_mtok_micros: 4}\n"
        )
        catalog = load_catalog(path)
        assert catalog.price_of("claude-opus-4") == price(1, 2)
        assert catalog.price_of("claude-opus-3") == price(15_000_000, 75_000_000)
        assert catalog.default == price(3, 4)

    def test_json_and_an_empty_file(self, tmp_path: Path) -> None:
        path = tmp_path / "prices.json"
        path.write_text(
            '{"list_prices": {"m": {"input_per_mtok_micros": 1, "output_per_mtok_micros": 2}}}'
        )
        assert load_catalog(path).price_of("m") == price(1, 2)
        empty = tmp_path / "empty.yaml"
        empty.write_text("")
        assert load_catalog(empty) == PriceCatalog()

    @pytest.mark.parametrize(
        ("text", "named"),
        [
            (
                "overrides: {m: {input_per_mtok_micros: -1, output_per_mtok_micros: 2}}",
                "overrides.m.input_per_mtok_micros",
            ),
            (
                "list_prices: {m: {input_per_mtok_micros: 1}}",
                "list_prices.m.output_per_mtok_micros",
            ),
            (
                "list_prices: {m: {input_per_mtok_micros: 1.5, output_per_mtok_micros: 2}}",
                "list_prices.m.input_per_mtok_micros",
            ),
            (
                "default: {input_per_mtok_micros: 1, output_per_mtok_micros: 2, typo: 3}",
                "default.typo",
            ),
            ("prices: {}", "prices"),
            ("- a list", "mapping"),
            ("list_prices: [unclosed", "not valid YAML"),
        ],
    )
    def test_errors_name_the_field(self, tmp_path: Path, text: str, named: str) -> None:
        path = tmp_path / "prices.yaml"
        path.write_text(text)
        with pytest.raises(ConfigurationError, match=named) as info:
            load_catalog(path)
        assert str(path) in str(info.value)

    def test_a_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigurationError, match="cannot read"):
            load_catalog(tmp_path / "absent.yaml")
