"""The worker's five Redis scripts, each through its contract (``streams/scripts``).

Each args type must encode KEYS and ARGV exactly as the script reads them (the pure tests
pin the lists the worker sent before the contracts existed), and each reply type must decode
what the script answers; the script runs on the real Redis.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from importlib import import_module, resources
from pathlib import Path

import pytest
import redis

from spendgate.schemas.redis_keys import (
    mark_owners_key,
    mark_positions_key,
    mark_progress_key,
    marks_key,
    pending_queue_key,
    pending_reservations_key,
    pending_total_key,
    pending_window_key,
    utilization_key,
    window_key,
    window_version_key,
)
from spendgate.schemas.redis_values import PendingEntry
from spendgate.streams.marks import Claim
from spendgate.streams.scripts import absorb, claim, heal, mark, sample
from spendgate.streams.scripts.absorb import AbsorbArgs, AbsorbKey, AbsorbReply
from spendgate.streams.scripts.claim import ClaimArgs, ClaimReply
from spendgate.streams.scripts.heal import HealArgs, HealReply
from spendgate.streams.scripts.mark import MarkArgs, MarkReply, MarkWrite
from spendgate.streams.scripts.sample import SampleArgs, SampleReply
from tests.fixtures import held

pytestmark = pytest.mark.integration

SCRIPTS = ("absorb", "heal", "claim", "sample", "mark")
PACKAGE = "spendgate.streams.scripts"
KEY = "p|tenant=acme"
MINUTE = 60_000


def _absorb_key(prefix: str, key: str = KEY, **values: object) -> AbsorbKey:
    return AbsorbKey(
        window_key=window_key(prefix, key),
        pending_window_key=pending_window_key(prefix, key),
        pending_total_key=pending_total_key(prefix, key),
        pending_queue_key=pending_queue_key(prefix, key),
        pending_reservations_key=pending_reservations_key(prefix, key),
        version_key=window_version_key(prefix, key),
        utilization_key=utilization_key(prefix),
        **values,  # type: ignore[arg-type]
    )


def _heal_args(prefix: str, window: bytes, version: int, score: float | None = None) -> HealArgs:
    return HealArgs(
        window_key=window_key(prefix, KEY),
        version_key=window_version_key(prefix, KEY),
        utilization_key=utilization_key(prefix),
        window=window,
        window_ms=MINUTE,
        version=version,
        score=score,
    )


def _claim_args(prefix: str, fields: tuple[str, ...]) -> ClaimArgs:
    return ClaimArgs(
        owners_key=mark_owners_key(prefix),
        marks_key=marks_key(prefix),
        positions_key=mark_positions_key(prefix),
        presence_key=f"{prefix}worker:a",
        fields=fields,
    )


def _mark_args(prefix: str, *writes: MarkWrite) -> MarkArgs:
    return MarkArgs(
        marks_key=marks_key(prefix),
        owners_key=mark_owners_key(prefix),
        progress_key=mark_progress_key(prefix),
        positions_key=mark_positions_key(prefix),
        presence_key=f"{prefix}worker:a",
        writes=writes,
    )


class TestContracts:
    """Pure: each args type's KEYS and ARGV as the worker sent them, each reply decoded."""

    def test_absorb_encodes_each_budget_keys_seven_keys_and_five_plus_n_values(self) -> None:
        first = AbsorbKey(
            "w1",
            "pw1",
            "pv1",
            "pq1",
            "pr1",
            "v1",
            "u",
            b"\x01win",
            60_000,
            7,
            0.25,
            ("r-1", "r-2"),
        )
        second = AbsorbKey("w2", "pw2", "pv2", "pq2", "pr2", "v2", "u", None, 3_600_000)
        args = AbsorbArgs([first, second])
        assert args.keys() == [
            *("w1", "pw1", "pv1", "pq1", "pr1", "v1", "u"),
            *("w2", "pw2", "pv2", "pq2", "pr2", "v2", "u"),
        ]
        assert args.argv() == [
            *(b"\x01win", 120_000, 7, "0.250000", 2, "r-1", "r-2"),
            *(b"", 7_200_000, "", "", 0),
        ]
        # A version of 0 is a version (compared), not "none".
        assert AbsorbKey("w", "pw", "pv", "pq", "pr", "v", "u", b"x", 1_000, 0, 1 / 3).argv() == [
            b"x",
            2_000,
            0,
            "0.333333",
            0,
        ]
        assert AbsorbReply.decode(30) == AbsorbReply(30)

    def test_heal_encodes_the_window_its_px_version_and_score(self) -> None:
        args = HealArgs("w", "v", "u", b"win", 3_600_000, 10)
        assert args.keys() == ["w", "v", "u"]
        assert args.argv() == [b"win", 7_200_000, 10, ""]
        scored = HealArgs("w", "v", "u", b"win", 60_000, 3, 2 / 3)
        assert scored.argv() == [b"win", 120_000, 3, "0.666667"]
        assert HealReply.decode(1) == HealReply(True)
        assert HealReply.decode(0) == HealReply(False)

    def test_claim_encodes_the_fields_and_decodes_three_values_each(self) -> None:
        args = ClaimArgs("owners", "marks", "positions", "presence", ("usage:0", "keyed:1"))
        assert args.keys() == ["owners", "marks", "positions", "presence"]
        assert args.argv() == [0, "usage:0", "keyed:1"]
        generation = ClaimArgs("o", "m", "p", "w", ("usage:0",), generation=7)
        assert generation.argv() == [7, "usage:0"]
        reply = ClaimReply.decode([1, b"", b"", 2, b"1000", b"40"])
        assert reply.claims == (Claim(1, None, None), Claim(2, 1_000, 40))
        assert ClaimReply.decode([]).claims == ()
        with pytest.raises(ValueError, match="three per field"):
            ClaimReply.decode([1, b""])

    def test_sample_encodes_the_fields_and_decodes_the_clock_and_marks(self) -> None:
        args = SampleArgs("marks", ("usage:0", "usage:1"))
        assert (args.keys(), args.argv()) == (["marks"], ["usage:0", "usage:1"])
        assert SampleReply.decode([1_700_000_000_123, b"10", b""]) == SampleReply(
            1_700_000_000_123, (10, None)
        )
        with pytest.raises(ValueError, match="no mark fields"):
            SampleArgs("marks", ())

    def test_mark_encodes_five_values_per_write_none_as_empty(self) -> None:
        writes = (
            MarkWrite("usage:0", 3, 1_000, 7, 40),
            MarkWrite("keyed:1", 2, None),
            MarkWrite("usage:1", 1, 0, behind=0, position=0),
        )
        args = MarkArgs("marks", "owners", "progress", "positions", "presence", writes)
        assert args.keys() == ["marks", "owners", "progress", "positions", "presence"]
        assert args.argv() == [
            *("usage:0", 3, 1_000, 7, 40),
            *("keyed:1", 2, "", "", ""),
            *("usage:1", 1, 0, 0, 0),
        ]
        assert MarkReply.decode([1, 2, 0]) == MarkReply(True, 2, 0)
        assert MarkReply.decode([0, 0, 0]) == MarkReply(False, 0, 0)

    @pytest.mark.parametrize("name", SCRIPTS)
    def test_each_script_file_names_its_contract_and_documents_its_keys_argv_reply(
        self, name: str
    ) -> None:
        module = import_module(f"{PACKAGE}.{name}")
        assert module.SCRIPT.name == f"{PACKAGE}:{name}"
        text = resources.files(PACKAGE).joinpath(f"{name}.lua").read_text(encoding="utf-8")
        header: list[str] = []
        for line in text.splitlines():
            if not line.startswith("--") or line.startswith("--!"):
                break
            header.append(line)
        assert header[0].startswith(f"-- {name.upper()}: ")
        assert f"-- Contract: {PACKAGE}.{name}" in header
        for section in ("-- KEYS", "-- ARGV", "-- Reply"):
            assert any(line.startswith(section) for line in header), (name, section)
        assert "--! include" not in module.SCRIPT.source
        assert module.SCRIPT.source.startswith(header[0])

    def test_absorb_reads_the_pending_entry_through_the_shared_codec(self) -> None:
        assert "local function pending_entry_decode" in absorb.SCRIPT.source
        assert "string.match(record" not in absorb.SCRIPT.source

    def test_no_lua_is_left_in_a_python_string_in_the_worker(self) -> None:
        streams = Path(absorb.__file__).parent.parent
        for path in streams.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    assert "redis.call(" not in node.value, path


class TestAbsorbScript:
    def test_a_pending_entry_moves_out_and_the_window_its_version_and_score_are_written(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(absorb.SCRIPT.source)
        field = 1_700_000_059_999
        pw, pr = pending_window_key(key_prefix, KEY), pending_reservations_key(key_prefix, KEY)
        redis_sync.hset(pw, str(field), 300)
        redis_sync.hset(
            pr,
            mapping={
                "r-1": PendingEntry(field, 100).encode(),
                "r-2": PendingEntry(field, 200).encode(),
            },
        )
        part = _absorb_key(
            key_prefix,
            window=b"window-1",
            window_ms=MINUTE,
            version=3,
            score=0.5,
            reservation_ids=("r-1", "r-none"),
        )
        args = AbsorbArgs([part])
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 100
        assert redis_sync.hgetall(pw) == {str(field).encode(): b"200"}
        assert redis_sync.hgetall(pr) == {b"r-2": PendingEntry(field, 200).encode().encode()}
        assert redis_sync.get(part.window_key) == b"window-1"
        assert redis_sync.get(part.version_key) == b"3"
        assert 0 < redis_sync.pttl(part.window_key) <= 2 * MINUTE
        assert 0 < redis_sync.pttl(part.version_key) <= 2 * MINUTE
        assert redis_sync.zscore(part.utilization_key, part.window_key) == 0.5
        # Again: the entry is gone, nothing more moves (absorbing is idempotent).
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 0
        assert redis_sync.hgetall(pw) == {str(field).encode(): b"200"}

    @pytest.mark.parametrize(
        "field", [1_700_000_059_999, 99_999_999_999_999, 9_007_199_254_740_991]
    )
    def test_a_field_of_13_or_more_digits_is_found_exactly(
        self, redis_sync: redis.Redis, key_prefix: str, field: int
    ) -> None:
        # tostring() would write a number of 15+ digits with an exponent and miss the field.
        script = redis_sync.register_script(absorb.SCRIPT.source)
        pw, pr = pending_window_key(key_prefix, KEY), pending_reservations_key(key_prefix, KEY)
        redis_sync.hset(pw, mapping={str(field): 500, str(field - 1_000): 70})
        redis_sync.hset(
            pr,
            mapping={
                "r-part": PendingEntry(field, 200).encode(),
                "r-all": PendingEntry(field - 1_000, 70).encode(),
            },
        )
        args = AbsorbArgs(
            [_absorb_key(key_prefix, window=None, window_ms=MINUTE, reservation_ids=("r-part",))]
        )
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 200
        assert redis_sync.hget(pw, str(field)) == b"300"
        args = AbsorbArgs(
            [_absorb_key(key_prefix, window=None, window_ms=MINUTE, reservation_ids=("r-all",))]
        )
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 70
        assert redis_sync.hgetall(pw) == {str(field).encode(): b"300"}
        assert not redis_sync.exists(window_key(key_prefix, KEY))  # window None: left alone

    def test_a_stale_version_writes_no_window_nor_score_but_still_absorbs(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(absorb.SCRIPT.source)
        newer = _absorb_key(key_prefix, window=b"newer", window_ms=MINUTE, version=10, score=0.2)
        args = AbsorbArgs([newer])
        script(keys=args.keys(), args=args.argv())
        pw, pr = newer.pending_window_key, newer.pending_reservations_key
        redis_sync.hset(pw, "5999", 40)
        redis_sync.hset(pr, "r-1", PendingEntry(5_999, 40).encode())
        stale = _absorb_key(
            key_prefix,
            window=b"stale",
            window_ms=MINUTE,
            version=5,
            score=0.9,
            reservation_ids=("r-1",),
        )
        args = AbsorbArgs([stale])
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 40
        assert redis_sync.get(stale.window_key) == b"newer"
        assert redis_sync.get(stale.version_key) == b"10"
        assert redis_sync.zscore(stale.utilization_key, stale.window_key) == 0.2
        assert not redis_sync.exists(pw, pr)
        # The same version holds the same records: written again.
        same = _absorb_key(key_prefix, window=b"same", window_ms=MINUTE, version=10)
        args = AbsorbArgs([same])
        script(keys=args.keys(), args=args.argv())
        assert redis_sync.get(same.window_key) == b"same"

    def test_one_call_absorbs_each_budget_key_in_its_own_pending_window(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(absorb.SCRIPT.source)
        parts = []
        for i, (key, amount) in enumerate((("p|tenant=a", 10), ("p|tenant=b", 25))):
            redis_sync.hset(pending_window_key(key_prefix, key), "999", amount)
            redis_sync.hset(pending_reservations_key(key_prefix, key), f"r-{i}", f"999:{amount}")
            parts.append(
                _absorb_key(
                    key_prefix,
                    key,
                    window=f"w-{i}".encode(),
                    window_ms=MINUTE,
                    reservation_ids=(f"r-{i}",),
                )
            )
        args = AbsorbArgs(parts)
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 35
        for i, part in enumerate(parts):
            assert redis_sync.get(part.window_key) == f"w-{i}".encode()
            assert not redis_sync.exists(part.pending_window_key, part.pending_reservations_key)
            assert not redis_sync.exists(part.version_key)  # no version given


class TestAbsorbVersion2:
    def test_an_entry_in_the_hash_leaves_its_field_and_the_sum_the_last_clears_all(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(absorb.SCRIPT.source)
        part = _absorb_key(key_prefix, window=None, window_ms=MINUTE, reservation_ids=("r-1",))
        pv, pq, pr = part.pending_total_key, part.pending_queue_key, part.pending_reservations_key
        entries = {
            "r:r-2": PendingEntry(59_999, 40).encode(),
            "r:r-3": PendingEntry(119_999, 50).encode(),
        }
        redis_sync.hset(
            pv,
            mapping={
                "59999": 100,
                "119999": 50,
                "t": 150,
                "h": 59999,
                "n": 119999,
                "r:r-1": PendingEntry(59_999, 60).encode(),
                **entries,
            },
        )
        redis_sync.rpush(pq, "59999", "119999")
        redis_sync.hset(pr, "r-1", PendingEntry(999, 5).encode())  # the same id in version 1
        redis_sync.hset(part.pending_window_key, "999", 5)
        args = AbsorbArgs([part])
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 65
        assert redis_sync.hgetall(pv) == {
            b"59999": b"40",
            b"119999": b"50",
            b"t": b"90",
            b"h": b"59999",
            b"n": b"119999",
            **{k.encode(): v.encode() for k, v in entries.items()},
        }
        assert not redis_sync.exists(part.pending_window_key)
        assert held.pending_v2_consistent(redis_sync, key_prefix, KEY)
        rest = _absorb_key(
            key_prefix, window=None, window_ms=MINUTE, reservation_ids=("r-2", "r-3")
        )
        args = AbsorbArgs([rest])
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 90
        assert not redis_sync.exists(pv, pq, pr)

    def test_an_entry_whose_bucket_was_pruned_moves_nothing(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(absorb.SCRIPT.source)
        part = _absorb_key(key_prefix, window=None, window_ms=MINUTE, reservation_ids=("r-1",))
        pv, pr = part.pending_total_key, part.pending_reservations_key
        redis_sync.hset(
            pv, mapping={"119999": 50, "t": 50, "r:r-1": PendingEntry(59_999, 60).encode()}
        )
        redis_sync.rpush(part.pending_queue_key, "119999")
        args = AbsorbArgs([part])
        assert AbsorbReply.decode(script(keys=args.keys(), args=args.argv())).moved == 0
        assert redis_sync.hgetall(pv) == {b"119999": b"50", b"t": b"50"}
        assert not redis_sync.exists(pr)


class TestHealScript:
    def test_a_differing_window_is_rewritten_with_its_version_and_score(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(heal.SCRIPT.source)
        args = _heal_args(key_prefix, b"good", version=4, score=0.25)
        redis_sync.set(args.window_key, b"drift")
        redis_sync.set(args.version_key, 4)
        assert HealReply.decode(script(keys=args.keys(), args=args.argv())).rewritten
        assert redis_sync.get(args.window_key) == b"good"
        assert redis_sync.get(args.version_key) == b"4"
        assert 0 < redis_sync.pttl(args.window_key) <= 2 * MINUTE
        assert redis_sync.zscore(args.utilization_key, args.window_key) == 0.25
        redis_sync.delete(args.window_key)  # a deleted window comes back too
        assert HealReply.decode(script(keys=args.keys(), args=args.argv())).rewritten

    def test_a_matching_window_only_has_its_version_brought_forward(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(heal.SCRIPT.source)
        args = _heal_args(key_prefix, b"good", version=5, score=0.75)
        redis_sync.set(args.window_key, b"good")
        redis_sync.set(args.version_key, 3)
        assert not HealReply.decode(script(keys=args.keys(), args=args.argv())).rewritten
        assert redis_sync.get(args.version_key) == b"5"
        assert 0 < redis_sync.pttl(args.version_key) <= 2 * MINUTE
        assert redis_sync.pttl(args.window_key) == -1  # the window itself untouched
        assert redis_sync.zscore(args.utilization_key, args.window_key) is None

    def test_a_newer_window_in_redis_is_left_as_it_is(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(heal.SCRIPT.source)
        args = _heal_args(key_prefix, b"older", version=5, score=0.5)
        redis_sync.set(args.window_key, b"newer")
        redis_sync.set(args.version_key, 9)
        assert not HealReply.decode(script(keys=args.keys(), args=args.argv())).rewritten
        assert redis_sync.get(args.window_key) == b"newer"
        assert redis_sync.get(args.version_key) == b"9"
        assert redis_sync.zscore(args.utilization_key, args.window_key) is None


class TestClaimScript:
    def test_tokens_increase_and_the_held_mark_and_position_come_back(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(claim.SCRIPT.source)
        args = _claim_args(key_prefix, ("usage:0", "keyed:1"))
        first = ClaimReply.decode(script(keys=args.keys(), args=args.argv()))
        assert first.claims == (Claim(1, None, None), Claim(1, None, None))
        assert redis_sync.get(args.presence_key) == b"1"
        redis_sync.hset(args.marks_key, "usage:0", 1_000)
        redis_sync.hset(args.positions_key, "usage:0", 40)
        redis_sync.delete(args.presence_key)
        second = ClaimReply.decode(script(keys=args.keys(), args=args.argv()))
        assert second.claims == (Claim(2, 1_000, 40), Claim(2, None, None))
        assert redis_sync.get(args.presence_key) == b"1"
        assert redis_sync.hgetall(args.owners_key) == {b"usage:0": b"2", b"keyed:1": b"2"}

    def test_a_claim_after_a_redis_wipe_never_fences_the_newer_generation(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        # A handover (generation 4 -> 5) with Redis losing its data in the middle: the new
        # owner claims again first, then the old owner, which has not seen its partition
        # move yet. The new owner must keep the higher token (its marks written) and the
        # old one be fenced; with tokens counted from 1 again the old one fenced the new
        # one until the next rebalance, and the partition refused everything.
        script = redis_sync.register_script(claim.SCRIPT.source)
        base = _claim_args(key_prefix, ("usage:0",))
        old, new = replace(base, generation=4), replace(base, generation=5)
        (first,) = ClaimReply.decode(script(keys=old.keys(), args=old.argv())).claims
        (handed,) = ClaimReply.decode(script(keys=new.keys(), args=new.argv())).claims
        assert handed.token > first.token
        redis_sync.delete(base.owners_key, base.marks_key, base.positions_key)  # the wipe
        (mine,) = ClaimReply.decode(script(keys=new.keys(), args=new.argv())).claims
        (stale,) = ClaimReply.decode(script(keys=old.keys(), args=old.argv())).claims
        assert stale.token < mine.token
        assert redis_sync.hget(base.owners_key, "usage:0") == str(mine.token).encode()
        marker = redis_sync.register_script(mark.SCRIPT.source)
        for token, written in ((stale.token, 0), (mine.token, 1)):
            args = _mark_args(key_prefix, MarkWrite("usage:0", token, 5_000))
            reply = MarkReply.decode(marker(keys=args.keys(), args=args.argv()))
            assert (reply.written, reply.fenced) == (written, 1 - written), token
        # Within a generation a claim still takes over (a loss seen by the owner itself).
        (again,) = ClaimReply.decode(script(keys=new.keys(), args=new.argv())).claims
        assert again.token == mine.token + 1


class TestSampleScript:
    def test_the_redis_clock_and_each_mark_missing_as_none(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        script = redis_sync.register_script(sample.SCRIPT.source)
        redis_sync.hset(marks_key(key_prefix), mapping={"usage:0": 10, "usage:2": 30})
        args = SampleArgs(marks_key(key_prefix), ("usage:0", "usage:1", "usage:2"))
        reply = SampleReply.decode(script(keys=args.keys(), args=args.argv()))
        seconds, micros = redis_sync.time()
        assert reply.marks == (10, None, 30)
        assert 0 <= seconds * 1000 + micros // 1000 - reply.now_ms < 5_000


class TestMarkScript:
    def _run(self, client: redis.Redis, prefix: str, *writes: MarkWrite) -> MarkReply:
        script = client.register_script(mark.SCRIPT.source)
        args = _mark_args(prefix, *writes)
        return MarkReply.decode(script(keys=args.keys(), args=args.argv()))

    def test_a_lower_token_is_fenced_and_the_same_token_never_lowers_the_mark(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        marks, owners = marks_key(key_prefix), mark_owners_key(key_prefix)
        redis_sync.set(f"{key_prefix}worker:a", b"1")
        redis_sync.hset(owners, "usage:0", 2)
        reply = self._run(redis_sync, key_prefix, MarkWrite("usage:0", 1, 5_000, 3, 9))
        assert reply == MarkReply(True, 0, 1)
        assert not redis_sync.exists(marks, mark_progress_key(key_prefix))
        assert not redis_sync.exists(mark_positions_key(key_prefix))
        for w, written in ((1_000, 1), (900, 0), (1_000, 0), (2_000, 1)):
            reply = self._run(redis_sync, key_prefix, MarkWrite("usage:0", 2, w))
            assert reply == MarkReply(True, written, 0), w
        assert redis_sync.hget(marks, "usage:0") == b"2000"
        # A higher token (a newer claim) writes its mark and becomes the owner.
        assert self._run(redis_sync, key_prefix, MarkWrite("usage:0", 3, 1_500)).written == 1
        assert redis_sync.hget(marks, "usage:0") == b"1500"
        assert redis_sync.hget(owners, "usage:0") == b"3"

    def test_progress_carries_the_redis_clock_and_positions_only_rise(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        positions = mark_positions_key(key_prefix)
        redis_sync.set(f"{key_prefix}worker:a", b"1")
        write = MarkWrite("keyed:1", 1, None, behind=7, position=40)
        assert self._run(redis_sync, key_prefix, write) == MarkReply(True, 0, 0)
        behind, at = redis_sync.hget(mark_progress_key(key_prefix), "keyed:1").split(b":")
        seconds, micros = redis_sync.time()
        assert int(behind) == 7
        assert 0 <= seconds * 1000 + micros // 1000 - int(at) < 5_000
        assert redis_sync.hget(marks_key(key_prefix), "keyed:1") is None
        self._run(redis_sync, key_prefix, MarkWrite("keyed:1", 1, None, position=30))
        assert redis_sync.hget(positions, "keyed:1") == b"40"
        self._run(redis_sync, key_prefix, MarkWrite("keyed:1", 1, None, position=50))
        assert redis_sync.hget(positions, "keyed:1") == b"50"

    def test_nothing_is_written_without_the_presence_key(
        self, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        write = MarkWrite("usage:0", 1, 1_000, behind=2, position=5)
        assert self._run(redis_sync, key_prefix, write) == MarkReply(False, 0, 0)
        assert list(redis_sync.scan_iter(match=f"{key_prefix}*")) == []
