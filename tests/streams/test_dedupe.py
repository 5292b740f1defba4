"""The dedupe id set: duplicates within the horizon, redeliveries, expiry, restarts."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.policies import Policy
from spendgate.streams.dedupe import IdStore, Position, event_digest, settled_digest
from tests.fixtures.fanout import fan_out

HOUR = 3_600_000


class TestVerdicts:
    def test_new_redelivery_duplicate_and_beyond_the_horizon(self, tmp_path: Path) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        d = event_digest("acme", "e1")
        assert ids.check(Position(0, 5, 1_000), d) == "new"
        assert ids.check(Position(0, 5, 1_000), d) == "redelivery"
        assert ids.check(Position(0, 9, 1_000 + HOUR), d) == "duplicate"
        assert ids.check(Position(0, 12, 1_001 + HOUR), d) == "new"
        ids.close()

    def test_ids_are_scoped_by_tenant_and_partition(self, tmp_path: Path) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        assert ids.check(Position(0, 1, 1_000), event_digest("a", "e1")) == "new"
        assert ids.check(Position(0, 2, 1_000), event_digest("b", "e1")) == "new"
        assert ids.check(Position(1, 1, 1_000), event_digest("a", "e1")) == "new"
        ids.close()

    def test_a_restart_keeps_the_ids_and_the_covered_offset(self, tmp_path: Path) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        for offset in range(100):
            pos = Position(3, offset, 10_000 + offset)
            ids.check(pos, event_digest("t", f"e{offset}"))
            ids.advance(pos)
        ids.close()
        again = IdStore(tmp_path / "ids", HOUR)
        assert again.covered(3) == 99
        assert again.check(Position(3, 120, 20_000), event_digest("t", "e42")) == "duplicate"
        assert again.check(Position(3, 42, 10_042), event_digest("t", "e42")) == "redelivery"
        again.close()

    def test_old_slices_are_dropped_so_disk_use_follows_the_horizon(self, tmp_path: Path) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        # Ten hours of ids, one every 3.6 s: only the last horizon's slices survive.
        for i in range(10_000):
            pos = Position(0, i, i * 3_600)
            ids.check(pos, event_digest("t", f"e{i}"))
            ids.advance(pos)
        slices = [n for n in ids._cfs if n.startswith("p0.")]
        assert len(slices) <= 6  # the horizon is four slices, plus the current and one edge
        ids.flush()
        assert ids.size() <= 1_000 * 6 // 4 + 50
        ids.close()

    def test_settled_marks_are_seen_only_from_later_records(self, tmp_path: Path) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        mark = settled_digest("t", "r1")
        ids.remember(Position(0, 10, 1_000), mark)
        assert ids.seen_before(Position(0, 11, 2_000), mark)
        assert not ids.seen_before(Position(0, 9, 900), mark)  # a reserve read again, earlier
        assert not ids.seen_before(Position(0, 30, 1_001 + HOUR), mark)
        ids.close()


@st.composite
def histories(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]], int]:
    """A horizon, records (id, arrival) in arrival order, and where a crash rewinds to."""
    horizon = draw(st.integers(1_000, 1_800_000))
    steps = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, horizon)), max_size=80))
    arrival, records = 0, []
    for ident, step in steps:
        arrival += step
        records.append((ident, arrival))
    rewind = draw(st.integers(0, len(records)))
    return horizon, records, rewind


def brute_force(horizon: int, records: list[tuple[int, int]]) -> list[bool]:
    """Whether each record is a duplicate: an earlier *counted* record with the same id
    arrived at most ``horizon`` before it."""
    counted: dict[int, int] = {}
    out = []
    for ident, arrival in records:
        dup = ident in counted and arrival - counted[ident] <= horizon
        if not dup:
            counted[ident] = arrival
        out.append(dup)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdStore]:
    ids = IdStore(tmp_path_factory.mktemp("oracle") / "ids", 10 * 86_400_000)
    yield ids
    ids.close()


class TestAgainstABruteForceOracle:
    # One database for every example (opening RocksDB and creating slices is slow); each
    # example is its own tenant, so examples never see each other's ids. The store's
    # slices (2.5 days) are wider than any example's horizon, so ids counted again within
    # one slice are exercised too.
    TENANTS = itertools.count()

    @given(history=histories())
    def test_verdicts_match_and_survive_a_rewind(
        self, store: IdStore, history: tuple[int, list[tuple[int, int]], int]
    ) -> None:
        horizon, records, rewind = history
        expected = brute_force(horizon, records)
        tenant = f"x{next(self.TENANTS)}"
        ids = store
        ids.horizon_ms = horizon

        def read(offset: int) -> str:
            ident, arrival = records[offset]
            pos = Position(0, offset, arrival)
            verdict = ids.check(pos, event_digest(tenant, str(ident)))
            ids.advance(pos)
            return verdict

        for offset in range(len(records)):
            assert (read(offset) == "duplicate") == expected[offset], offset
        # A crash: the records after the last commit are read again. Within one slice
        # of the newest arrival (the promise), each is a duplicate exactly as before.
        newest = records[-1][1] if records else 0
        for offset in range(rewind, len(records)):
            if newest - records[offset][1] > ids.slice_ms:
                continue
            again = read(offset)
            assert (again == "duplicate") == expected[offset], ("re-read", offset)
            assert again != "new" or expected[offset] is False


class TestFanOutWithIds:
    POLICIES = [Policy(id="tokens", unit="total_tokens", limit=1000, group_by=["tenant"])]

    def raw(self, **overrides: object) -> bytes:
        event = {
            "event_id": "e1",
            "kind": "commit",
            "subject": {"tenant": "acme"},
            "occurred_at": "2027-01-15T08:00:00Z",
            "usage": {"input_tokens": 5},
        }
        event.update(overrides)
        return json.dumps(event).encode()

    def run(self, ids: IdStore, raw: bytes, offset: int) -> object:
        pos = Position(0, offset, 1_800_000_000_000 + offset)
        out = fan_out(
            raw,
            broker_ms=pos.arrival_ms,
            policies=self.POLICIES,
            prices=None,
            max_future_skew_ms=300_000,
            src=pos,
            ids=ids,
        )
        ids.advance(pos)
        return out

    def test_a_producer_duplicate_yields_no_records(self, tmp_path: Path) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        first = self.run(ids, self.raw(), 0)
        second = self.run(ids, self.raw(), 1)
        assert len(first.records) == 1 and not first.duplicate  # type: ignore[attr-defined]
        assert second.duplicate and not second.records  # type: ignore[attr-defined]
        again = self.run(ids, self.raw(), 0)  # the first record, redelivered
        assert len(again.records) == 1  # type: ignore[attr-defined]
        ids.close()

    def test_a_reserve_after_its_commit_is_marked_settled(self, tmp_path: Path) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        self.run(ids, self.raw(event_id="c", reservation_id="r1"), 0)
        reserve = self.raw(
            event_id="r",
            kind="reserve",
            reservation_id="r1",
            expires_at="2027-01-15T08:15:00Z",
        )
        out = self.run(ids, reserve, 1)
        assert [r.settled for r in out.records] == [True]  # type: ignore[attr-defined]
        ids.close()

    def test_an_extend_after_its_commit_is_marked_settled_and_settles_nothing(
        self, tmp_path: Path
    ) -> None:
        ids = IdStore(tmp_path / "ids", HOUR)
        extend = self.raw(event_id="extend-1-r1", kind="extend", reservation_id="r1", seq=1)
        self.run(ids, extend, 0)
        reserve = self.raw(
            event_id="r", kind="reserve", reservation_id="r1", expires_at="2027-01-15T08:15:00Z"
        )
        after = self.run(ids, reserve, 1)  # an extend does not settle its reservation
        assert [r.settled for r in after.records] == [False]  # type: ignore[attr-defined]
        self.run(ids, self.raw(event_id="c", reservation_id="r1"), 2)
        late = self.raw(event_id="extend-2-r1", kind="extend", reservation_id="r1", seq=2)
        out = self.run(ids, late, 3)
        assert [r.settled for r in out.records] == [True]  # type: ignore[attr-defined]
        ids.close()
