"""``schemas.status.classify``: the admit script's classification of a mark, pure."""

from __future__ import annotations

from spendgate.schemas.shards import Topology
from spendgate.schemas.status import classify, parse_int, parse_lag

NOW = 1_800_000_000_000
BOUND = 30_000
ONE = Topology(usage=1, keyed=0)


def _state(watermark: bytes | str | None) -> str:
    marks = {} if watermark is None else {"usage:0": watermark}
    status = classify(
        now_ms=NOW, staleness_ms=BOUND, topology=ONE, marks=marks, progress={}, owners={}
    )
    return status.partitions[0].state


class TestClassify:
    def test_the_bound_itself_is_vouched_one_ms_beyond_is_stale(self) -> None:
        # The script: stale when watermark < now - bound.
        assert _state(str(NOW - BOUND)) == "vouched"
        assert _state(str(NOW - BOUND - 1)) == "stale"
        assert _state(b"%d" % (NOW + 5_000)) == "vouched"

    def test_absent_or_unreadable_is_missing(self) -> None:
        assert _state(None) == "missing"
        assert _state("not-a-number") == "missing"

    def test_decidable_only_when_every_mark_is_vouched(self) -> None:
        topology = Topology(usage=2, keyed=1)
        marks = {"usage:0": str(NOW), "usage:1": str(NOW), "keyed:0": str(NOW)}
        common = {"now_ms": NOW, "staleness_ms": BOUND, "topology": topology}
        assert classify(**common, marks=marks, progress={}, owners={}).decidable
        del marks["keyed:0"]
        status = classify(**common, marks=marks, progress={}, owners={})
        assert not status.decidable and "keyed:0 missing" in (status.reason or "")

    def test_no_topology(self) -> None:
        status = classify(
            now_ms=NOW, staleness_ms=BOUND, topology=None, marks={}, progress={}, owners={}
        )
        assert not status.decidable and status.partitions == [] and status.topology is None


class TestParsing:
    def test_integers(self) -> None:
        assert parse_int(b"42") == 42 and parse_int("7") == 7 and parse_int("1e3") == 1000
        assert parse_int(None) is None and parse_int("x") is None and parse_int("inf") is None

    def test_lag(self) -> None:
        lag = parse_lag(b"12:%d" % (NOW - 250), NOW)
        assert lag is not None and (lag.records_behind, lag.age_ms) == (12, 250)
        assert parse_lag(None, NOW) is None
        assert parse_lag("12", NOW) is None and parse_lag("a:b", NOW) is None
