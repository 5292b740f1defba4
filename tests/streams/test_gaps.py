"""Which offsets a stream skipped, from the last one handled and the group's commit."""

from __future__ import annotations

from spendgate.streams.gaps import (
    Positions,
    applied_key,
    applied_offset,
    is_budget_key,
    missing_range,
)


class TestMissingRange:
    def test_contiguous_records_skip_nothing(self) -> None:
        assert list(missing_range(41, None, 42)) == []

    def test_a_hole_mid_stream_is_read_back(self) -> None:
        assert list(missing_range(989, None, 991)) == [990]

    def test_a_redelivery_behind_the_last_offset_skips_nothing(self) -> None:
        assert list(missing_range(100, None, 60)) == []

    def test_after_assignment_the_records_from_the_commit_on_are_read_back(self) -> None:
        # The group committed 500; the stream's first record is 503: 500..502 skipped.
        assert list(missing_range(None, 500, 503)) == [500, 501, 502]
        assert list(missing_range(None, 500, 500)) == []

    def test_without_a_commit_everything_before_the_first_record_is_read_back(self) -> None:
        # The group never committed (committed_offset answers 0): the stream should have
        # started at the earliest record. Seen: a first record at 1,099.
        assert list(missing_range(None, 0, 3)) == [0, 1, 2]

    def test_when_nothing_is_known_nothing_is_read_back(self) -> None:
        assert list(missing_range(None, None, 7)) == []

    def test_a_commit_ahead_of_the_stream_reads_nothing(self) -> None:
        assert list(missing_range(None, 900, 850)) == []

    def test_a_commit_ahead_of_the_table_is_read_back_from_what_the_table_applied(self) -> None:
        # faust committed 503 (records it acked as skipped among them); the table applied
        # up to 499: 500..502 were never applied, whatever the commit says.
        assert list(missing_range(None, 503, 503, applied=499)) == [500, 501, 502]
        assert list(missing_range(None, None, 503, applied=501)) == [502]

    def test_a_table_at_or_ahead_of_the_commit_changes_nothing(self) -> None:
        assert list(missing_range(None, 500, 500, applied=499)) == []
        assert list(missing_range(None, 500, 500, applied=520)) == []
        assert list(missing_range(None, 500, 503, applied=520)) == [500, 501, 502]

    def test_mid_stream_the_last_offset_handled_decides(self) -> None:
        assert list(missing_range(41, 60, 42, applied=10)) == []


class TestAppliedPositions:
    def test_a_position_has_its_own_key_per_topic_and_partition(self) -> None:
        assert applied_key("budget.usage", 3) == "~applied|budget.usage|3"
        assert applied_key("budget.usage", 3) != applied_key("app-keyed", 3)
        assert not is_budget_key(applied_key("budget.usage", 3))
        assert is_budget_key("daily|tenant=acme") and is_budget_key("a.b-c_d|model=~x")

    def test_the_table_position_is_read_as_an_offset(self) -> None:
        table = {applied_key("usage", 0): b"41"}
        assert applied_offset(table, "usage", 0) == 41
        assert applied_offset(table, "usage", 1) is None


class TestPositions:
    def test_offsets_only_move_forward_and_are_forgotten_on_reassignment(self) -> None:
        positions = Positions()
        positions.handled(0, 10)
        positions.handled(0, 7)
        assert positions.last(0) == 10 and positions.last(1) is None
        positions.forget()
        assert positions.last(0) is None
