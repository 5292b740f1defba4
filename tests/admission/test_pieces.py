"""The pure parts of admission across shards: one answer from the pieces', and an answer
stored by SEAL replayed as ADMIT replays its own."""

from __future__ import annotations

import dataclasses

from spendgate.admission.pieces import Piece, merge
from spendgate.admission.plans import Charge, Plan
from spendgate.admission.scripts.admit import AdmitResult, KeyState
from spendgate.schemas.events import Subject
from spendgate.schemas.matching import BudgetTarget
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_values import decode_answer, encode_answer

POLICY = Policy.model_validate(
    {"id": "p", "limit": 10, "unit": "requests", "window": "1h", "group_by": ["tenant"]}
)


def _charge(key: str) -> Charge:
    return Charge(BudgetTarget(POLICY, key), 1)


def _result(outcome: str, keys: int, *, retry: int | None = None, cap: int | None = None,
            now: int = 1_000, own: int = 1) -> AdmitResult:  # fmt: skip
    return AdmitResult(
        replayed=False,
        outcome=outcome,  # type: ignore[arg-type]
        now_ms=now,
        retry_after_ms=retry,
        never_fits=False,
        reservation_id="s3-abc",
        plan=0,
        max_output_tokens=cap,
        keys=tuple(KeyState(i, 0, own, outcome == "reject", 5, "vouched") for i in range(keys)),
    )


PLAN = Plan(Subject(tenant="t"), (_charge("a"), _charge("b"), _charge("c")))
#: Key 0 and 2 on shard 1, key 1 on shard 9.
FIRST = Piece(1, (PLAN.charges[0], PLAN.charges[2]), (0, 2))
SECOND = Piece(9, (PLAN.charges[1],), (1,))


def test_a_refusing_piece_refuses_the_request_and_nothing_stays_own() -> None:
    merged = merge(
        PLAN, 0, "s3-abc", [(FIRST, _result("allow", 2)), (SECOND, _result("reject", 1, retry=70))]
    )
    assert merged.outcome == "reject"
    assert merged.retry_after_ms == 70
    assert [k.own for k in merged.keys] == [0, 0, 0]
    assert [k.used for k in merged.keys] == [0, 0, 1]


def test_the_lowest_cap_and_the_latest_instant_win() -> None:
    merged = merge(
        PLAN,
        0,
        "s3-abc",
        [(FIRST, _result("cap", 2, cap=40, now=5)), (SECOND, _result("cap", 1, cap=25, now=9))],
    )
    assert (merged.outcome, merged.max_output_tokens, merged.now_ms) == ("cap", 25, 9)
    assert [k.own for k in merged.keys] == [1, 1, 1]


def test_unvouched_outranks_a_refusal() -> None:
    merged = merge(
        PLAN, 0, "s3-abc", [(FIRST, _result("unvouched", 2)), (SECOND, _result("reject", 1))]
    )
    assert merged.outcome == "unvouched"


def test_a_stored_answer_replays_as_the_result_it_was() -> None:
    result = merge(
        PLAN, 0, "s3-abc", [(FIRST, _result("allow", 2)), (SECOND, _result("observe_reject", 1))]
    )
    stored = encode_answer(result.answer_values())
    replayed = AdmitResult.decode(["1", *decode_answer(stored)])
    assert replayed == dataclasses.replace(result, replayed=True)


def test_a_stored_extend_answer_replays_as_the_result_it_was() -> None:
    from spendgate.admission.scripts.extend import ExtendResult

    result = ExtendResult(
        False, "allow", 1_234, tuple(KeyState(i, 2, 3, False, 9, "stale") for i in range(3))
    )
    replayed = ExtendResult.decode(["1", *decode_answer(encode_answer(result.answer_values()))])
    assert replayed == dataclasses.replace(result, replayed=True)
