"""Each shared value's codec against its Lua twin, both ways, on a real Redis and embedded.

Python writes and Lua reads, then Lua writes and Python reads: the pending entry (ADMIT and
EXTEND write it, ABSORB reads it), the stored answer (ADMIT and EXTEND write and replay
it, Python decodes the replay), the reservation record (ADMIT writes it, SETTLE and EXTEND
check it, the reserve sweeper reads it) and the window value (the worker writes it, the
admit script, admission, the dashboard and replay read it).
"""

from __future__ import annotations

import json
import random

import pytest
import redis

from spendgate.schemas import window_codec
from spendgate.schemas.redis_values import (
    PendingEntry,
    ReservationRecord,
    decode_answer,
    encode_answer,
)
from spendgate.schemas.windows import rebucket
from tests.fixtures.embedded_lua import LuaServer, harness
from tests.fixtures.seeds import derive

VALUES = harness("redis_values_check")
DECODE = harness("window_decode_check")
SEED = derive("test_redis_values")
#: Amounts and instants as large as the scripts see (Redis ms now, sums below 2**53).
BIG = (0, 1, 9, 10**12, 1_700_000_000_123, 2**53 - 1)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class TestPendingEntry:
    @pytest.mark.parametrize("field", BIG)
    @pytest.mark.parametrize("amount", BIG)
    def test_python_writes_lua_reads(self, lua_server: LuaServer, field: int, amount: int) -> None:
        script = lua_server.script(VALUES)
        raw = PendingEntry(field, amount).encode()
        assert [int(v) for v in script(args=["pending_decode", raw])] == [field, amount]

    @pytest.mark.parametrize("field", BIG)
    @pytest.mark.parametrize("amount", BIG)
    def test_lua_writes_python_reads(self, lua_server: LuaServer, field: int, amount: int) -> None:
        script = lua_server.script(VALUES)
        raw = script(args=["pending_encode", field, amount])
        assert PendingEntry.decode(raw) == PendingEntry(field, amount)

    def test_the_field_is_the_last_ms_of_the_bucket_on_both_sides(
        self, lua_server: LuaServer
    ) -> None:
        rng = random.Random(SEED - 1)
        script = lua_server.script(VALUES)
        for _ in range(200):
            t_ms = rng.choice([0, 1, rng.randrange(2**43)])
            bucket_ms = rng.choice([1, 1_000, 60_000, 3_600_000, rng.randrange(1, 2**32)])
            lua = int(script(args=["pending_field", t_ms, bucket_ms]))
            assert lua == window_codec.pending_field(t_ms, bucket_ms)

    @pytest.mark.parametrize("raw", ["", "12", "12:", ":3", "a:1", "1:-2", "1:2:3"])
    def test_both_refuse_another_shape(self, lua_server: LuaServer, raw: str) -> None:
        with pytest.raises(ValueError, match="pending entry"):
            PendingEntry.decode(raw)
        with pytest.raises(redis.ResponseError, match="pending entry"):
            lua_server.script(VALUES)(args=["pending_decode", raw])


class TestStoredAnswer:
    def _values(self, rng: random.Random) -> list[int | str]:
        out: list[int | str] = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.2:
                out.append(f"r-{rng.randrange(10**9):x}")
            else:
                out.append(rng.choice([-2, -1, 0, 1, *BIG, rng.randrange(-(10**15), 10**15)]))
        return out

    def test_python_writes_lua_replays(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED)
        script = lua_server.script(VALUES)
        for _ in range(50):
            values = self._values(rng)
            replayed = script(args=["answer_decode", encode_answer(values)])
            assert replayed[0] == 1
            assert [_text(v) for v in replayed[1:]] == [str(v) for v in values]

    def test_lua_writes_python_reads(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED + 1)
        script = lua_server.script(VALUES)
        for _ in range(50):
            values = self._values(rng)
            args = [f"n:{v}" if isinstance(v, int) else v for v in values]
            stored = script(args=["answer_encode", *args])
            assert decode_answer(stored) == [str(v) for v in values]
            assert encode_answer(values) == _text(stored)

    @pytest.mark.parametrize("bad", ["", "a,b"])
    def test_a_value_that_would_not_come_back_is_refused(self, bad: str) -> None:
        with pytest.raises(ValueError, match="stored answer"):
            encode_answer([1, bad])


class TestReservationRecord:
    RECORD = ReservationRecord(
        subject_json=json.dumps({"tenant": "acme", "model": "m1"}, separators=(",", ":")),
        plan=2,
        usage_json='{"output_tokens":500}',
        at_ms=1_700_000_000_123,
        max_output_tokens=None,
        ttl_ms=900_000,
    )

    def test_lua_writes_python_reads(self, lua_server: LuaServer) -> None:
        key = f"{lua_server.prefix}rec"
        r = self.RECORD
        script = lua_server.script(VALUES)
        args = ["record_write", r.subject_json, r.plan, r.usage_json, r.at_ms, -1, r.ttl_ms]
        assert _text(script(keys=[key], args=[*args, 60_000])) == "ok"
        assert 0 < lua_server.client.pttl(key) <= 60_000
        assert ReservationRecord.decode(lua_server.client.hgetall(key)) == r
        script(keys=[key], args=["record_settle", "release"])
        settled = ReservationRecord.decode(lua_server.client.hgetall(key))
        assert settled is not None and settled.settled == "release"

    def test_python_writes_lua_reads(self, lua_server: LuaServer) -> None:
        key = f"{lua_server.prefix}rec"
        script = lua_server.script(VALUES)
        assert [_text(v) for v in script(keys=[key], args=["record_read"])] == ["", ""]
        capped = ReservationRecord(**{**_fields(self.RECORD), "max_output_tokens": 120})
        lua_server.client.hset(key, mapping=capped.encode())
        got = [_text(v) for v in script(keys=[key], args=["record_read"])]
        assert got == [capped.subject_json, ""]
        committed = ReservationRecord(**{**_fields(capped), "settled": "commit"})
        lua_server.client.hset(key, mapping=committed.encode())
        assert _text(script(keys=[key], args=["record_read"])[1]) == "commit"
        assert ReservationRecord.decode(lua_server.client.hgetall(key)) == committed

    def test_a_record_missing_a_field_is_none(self) -> None:
        fields = self.RECORD.encode()
        del fields["ttl"]
        assert ReservationRecord.decode(fields) is None
        assert ReservationRecord.decode({}) is None


def _fields(record: ReservationRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


class TestWindowValue:
    @pytest.mark.parametrize("read_ms", [1_000, 5_000, 10_000, 60_000])
    def test_every_reader_reads_what_the_worker_wrote(
        self, lua_server: LuaServer, read_ms: int
    ) -> None:
        """``window_codec.read`` (admission, the dashboard, replay) and the scripts'
        ``window_decode`` agree on dense and sparse values, in the written width and in
        another (a policy whose bucket changed)."""
        rng = random.Random(SEED + read_ms)
        script = lua_server.script(DECODE)
        key = f"{lua_server.prefix}w"
        for case in range(40):
            written_ms = 5_000
            base = 1_700_000_000_000 - 1_700_000_000_000 % written_ms
            span = rng.choice([3, 60, 1_440])
            dense = case % 2 == 0
            buckets = {
                base + i * written_ms: rng.randint(-50, 10**9)
                for i in range(span)
                if dense or rng.random() < 0.1
            }
            raw = window_codec.encode(buckets, written_ms)
            lua_server.client.set(key, raw)
            flat = script(keys=[key], args=[read_ms])
            lua = dict(zip(flat[0::2], flat[1::2], strict=True))
            python = window_codec.read(raw, read_ms)
            assert lua == python
            assert python == rebucket({k: v for k, v in buckets.items() if v}, written_ms, read_ms)

    def test_a_missing_value_is_an_empty_window(self, lua_server: LuaServer) -> None:
        assert lua_server.script(DECODE)(keys=[f"{lua_server.prefix}none"], args=[1_000]) == []
        assert window_codec.read(None, 1_000) == {}
