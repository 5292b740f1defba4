"""The decision's twin (``schemas.decision``) on hand-made cases, each rule of ADMIT's header
once; ``tests/admission/test_decision_twin.py`` pins it to the script on random cases."""

from __future__ import annotations

from dataclasses import replace

from spendgate.schemas.burst import BurstSpec, BurstState
from spendgate.schemas.decision import (
    NEVER_FITS,
    KeyInput,
    PlanInput,
    decide,
    key_state,
    marks_states,
    reset_after_ms,
)
from spendgate.schemas.windows import WindowSpec

SPEC = WindowSpec(60_000, 10_000, "include")
NOW = 1_700_000_005_000  # 5 s into a 10 s bucket
HEAD = NOW - NOW % 10_000


def key(used: int = 0, **fields: object) -> KeyInput:
    base = KeyInput(spec=SPEC, limit=100, amount=30, absorbed={HEAD: used} if used else {})
    return replace(base, **fields)  # type: ignore[arg-type]


def plans(*keys: tuple[KeyInput, ...]) -> list[PlanInput]:
    return [PlanInput(k) for k in keys]


class TestOutcomes:
    def test_every_key_fits_allows_and_holds_the_amount(self) -> None:
        got = decide(plans((key(10), key(70))), NOW, 50)
        assert got.outcome == "allow" and got.retry_after_ms is None
        assert [k.own for k in got.keys] == [30, 30]

    def test_one_key_over_rejects_with_the_wait_until_it_ages_out(self) -> None:
        got = decide(plans((key(10), key(80))), NOW, 50)
        assert got.outcome == "reject"
        assert [k.violated for k in got.keys] == [False, True]
        assert [k.own for k in got.keys] == [0, 0]
        # include: the head bucket counts until its last ms has left the window.
        assert got.retry_after_ms == HEAD + 60_000 + 9_999 - NOW

    def test_an_amount_above_the_limit_never_fits(self) -> None:
        got = decide(plans((key(0, amount=101),)), NOW, 50)
        assert got.outcome == "reject" and got.never_fits and got.retry_after_ms is None
        assert NEVER_FITS == -2

    def test_observe_keys_never_refuse_but_report(self) -> None:
        got = decide(plans((key(90, observe=True),)), NOW, 50)
        assert got.outcome == "observe_reject" and got.keys[0].violated
        assert got.keys[0].own == 30 and got.retry_after_ms is not None

    def test_cap_grants_the_output_every_enforce_key_fits(self) -> None:
        # amount = output tokens; 100 - 80 leaves 20 of the 30 asked.
        capped = key(80, on_exceed="cap", cap_r=1, amount=30)
        got = decide(plans((capped, key(0, cap_r=1, amount=30, limit=1000))), NOW, 30)
        assert got.outcome == "cap" and got.max_output_tokens == 20
        assert [k.own for k in got.keys] == [20, 20]

    def test_cap_of_a_unit_output_cannot_lower_rejects(self) -> None:
        got = decide(plans((key(80, on_exceed="cap", cap_r=0),)), NOW, 30)
        assert got.outcome == "reject"


class TestAlternatives:
    def test_tried_in_the_order_their_keys_come_the_first_that_decides_wins(self) -> None:
        first = key(90, on_exceed="alternative", alternative=2)
        second = key(90, on_exceed="alternative", alternative=1)
        # Both alternatives fit: plan 2's key comes first in plan 0, so plan 2 wins.
        got = decide(plans((first, second), (key(0),), (key(0),)), NOW, 50)
        assert got.outcome == "allow" and got.plan == 2
        # Plan 2 refusing, plan 1 is tried next.
        got = decide(plans((first, second), (key(0),), (key(90),)), NOW, 50)
        assert got.outcome == "allow" and got.plan == 1
        assert [k.own for k in got.keys] == [30]

    def test_a_hard_refusal_beside_an_alternative_rejects_without_trying_it(self) -> None:
        alt = key(90, on_exceed="alternative", alternative=1)
        got = decide(plans((alt, key(90)), (key(0),)), NOW, 50)
        assert got.outcome == "reject" and got.plan == 0

    def test_every_alternative_refusing_reports_plan_0(self) -> None:
        alt = key(90, on_exceed="alternative", alternative=1)
        got = decide(plans((alt,), (key(90),)), NOW, 50)
        assert got.outcome == "reject" and got.plan == 0 and got.keys[0].violated


class TestUnvouched:
    def test_a_stale_closed_key_makes_the_outcome_unvouched_before_anything_else(self) -> None:
        got = decide(plans((key(0, state="stale"), key(99))), NOW, 50)
        assert got.outcome == "unvouched" and [k.own for k in got.keys] == [0, 0]

    def test_an_open_key_neither_blocks_nor_refuses(self) -> None:
        got = decide(plans((key(99, state="missing", failure="open"),)), NOW, 50)
        assert got.outcome == "allow" and not got.keys[0].violated

    def test_observe_keys_and_read_only_evaluations_are_not_blocked(self) -> None:
        assert decide(plans((key(0, state="stale", observe=True),)), NOW, 50).outcome == "allow"
        ro = decide(plans((key(0, state="missing"),)), NOW, 50, read_only=True)
        assert ro.outcome == "allow"

    def test_marks_states_and_the_worst_of_a_keys_deps(self) -> None:
        states = marks_states([NOW, NOW - 61_000, None], NOW, 60_000)
        assert states == ["vouched", "stale", "missing"]
        assert key_state([0, 1], states) == "stale"
        assert key_state([2, 1], states) == "missing"
        assert key_state([], states) == "vouched"

    def test_a_mark_exactly_at_the_staleness_bound_is_vouched_and_1_ms_older_stale(self) -> None:
        # The boundary as the README states it ("older than the staleness bound" is stale),
        # pinned here apart from the Lua/twin cross-check, which compares the two only.
        got = marks_states([NOW - 60_000 + 1, NOW - 60_000, NOW - 60_001], NOW, 60_000)
        assert got == ["vouched", "vouched", "stale"]


class TestBurst:
    def test_the_bucket_refuses_beside_the_window_and_its_refill_is_the_wait(self) -> None:
        spec = BurstSpec(1, 1000, 40)  # 1 token a second, 40 at most
        bucket = BurstState(10 * 1000, NOW)  # 10 tokens now
        got = decide(plans((key(0, burst=spec, bucket=bucket),)), NOW, 50)
        assert got.outcome == "reject" and got.keys[0].violated
        assert got.retry_after_ms == 20_000  # 20 more tokens at 1/s
        assert got.keys[0].burst == (10, 30_000)

    def test_an_admitted_request_takes_its_amount(self) -> None:
        spec = BurstSpec(1, 1000, 40)
        got = decide(plans((key(0, burst=spec),)), NOW, 50)
        assert got.outcome == "allow"
        assert got.keys[0].burst == (10, 30_000)
        assert got.keys[0].bucket_after == BurstState(10_000, NOW)


class TestReset:
    def test_own_amount_counts_from_the_bucket_of_now(self) -> None:
        assert reset_after_ms(SPEC, {}, NOW, 0) == 0
        assert reset_after_ms(SPEC, {}, NOW, 5) == HEAD + 60_000 + 9_999 - NOW
        exclude = WindowSpec(60_000, 10_000, "exclude")
        assert reset_after_ms(exclude, {HEAD: 5}, NOW, 0) == HEAD + 60_000 - NOW
