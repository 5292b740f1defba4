"""When the worker may write each applied mark, and which watermark (``streams.marks``)."""

from __future__ import annotations

from streams.marks import MarkKeeper, Progress


class TestDue:
    def test_caught_up_is_the_present_and_behind_is_the_last_record_time(self) -> None:
        due = MarkKeeper().due(
            {
                "usage:0": Progress(position=10, end=10, broker_ms=5),
                "usage:1": Progress(position=7, end=10, broker_ms=1234),
            },
            usage_marks_complete=True,
        )
        assert due == {"usage:0": None, "usage:1": 1234}

    def test_nothing_handled_and_records_left_writes_nothing(self) -> None:
        due = MarkKeeper().due({"usage:0": Progress(None, 3, None)}, True)
        assert due == {}


class TestAfterALoss:
    def test_a_usage_mark_returns_only_past_the_end_seen_at_the_loss(self) -> None:
        keeper = MarkKeeper()
        keeper.lost({"usage:0": 50}, keyed=[])
        assert keeper.holding
        # Behind the end offset of the loss: held even though a watermark is known.
        assert keeper.due({"usage:0": Progress(40, 60, 999)}, True) == {}
        assert keeper.due({"usage:0": Progress(50, 60, 1000)}, True) == {"usage:0": 1000}
        assert not keeper.holding
        # Released for good: later ticks write as usual.
        assert keeper.due({"usage:0": Progress(55, 60, 1001)}, True) == {"usage:0": 1001}

    def test_a_keyed_mark_takes_its_end_only_once_every_usage_mark_is_back(self) -> None:
        keeper = MarkKeeper()
        keeper.lost({}, keyed=["keyed:1"])
        caught_up = Progress(position=20, end=20, broker_ms=7)
        assert keeper.due({"keyed:1": caught_up}, usage_marks_complete=False) == {}
        # Usage marks back: the end offset now (25) must be reached, 20 is not enough.
        assert keeper.due({"keyed:1": Progress(20, 25, 7)}, True) == {}
        assert keeper.due({"keyed:1": Progress(25, 25, 8)}, True) == {"keyed:1": None}

    def test_a_partition_given_away_is_no_longer_held(self) -> None:
        keeper = MarkKeeper()
        keeper.lost({"usage:0": 50, "usage:1": 10}, keyed=[])
        keeper.due({"usage:1": Progress(10, 10, 1)}, True)
        assert not keeper.holding
