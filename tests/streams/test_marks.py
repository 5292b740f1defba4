"""The applied watermarks (``streams.marks``) against the truth they claim, on random histories.

The model under test emits concrete watermarks (never "now"); the test keeps its own truth:
each record's log-append time and which records Redis holds, and its own copy of the mark
script's fencing rule (a lower token, or a lower watermark with the same token, is refused).
After every step the mark Redis holds must be at most the truth (the greatest t such that
every record appended at or before t is applied), and it never moves back except when
Redis itself lost it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from spendgate.streams.marks import Claim, Watermarks

F = "usage:0"
K = "keyed:0"


@dataclass
class Redis:
    """The marks as the claim and mark scripts keep them (the rules restated, not
    imported): a claim raises the field's owner token; a write with a lower token is
    refused, and one with the same token only raises the watermark."""

    marks: dict[str, int] = field(default_factory=dict)
    owners: dict[str, int] = field(default_factory=dict)
    #: The workers whose presence mark is set (each sets its own when it claims).
    present: set[int] = field(default_factory=set)

    def claim(self, name: str, worker: int) -> Claim:
        self.present.add(worker)
        self.owners[name] = self.owners.get(name, 0) + 1
        return Claim(self.owners[name], self.marks.get(name))

    def write(self, name: str, token: int, w: int | None, worker: int) -> None:
        owner = self.owners.get(name, -1)
        if w is None or worker not in self.present or token < owner:
            return
        if token > owner or w > self.marks.get(name, -1):
            self.marks[name] = w
            self.owners[name] = token

    def mark(self, name: str) -> int | None:
        return self.marks.get(name)

    def flush(self) -> None:
        self.marks.clear()
        self.owners.clear()
        self.present.clear()


@dataclass
class Owner:
    wm: Watermarks
    worker: int
    token: int
    #: Next offset this owner applies.
    position: int


@dataclass
class World:
    """One usage partition: its records, what Redis holds, the owners."""

    clock: int = 1_000
    times: list[int] = field(default_factory=list)
    applied: int = 0
    redis: Redis = field(default_factory=Redis)
    owner: Owner | None = None
    stale: Owner | None = None
    last_mark: int | None = None

    def truth(self) -> int:
        if self.applied < len(self.times):
            return self.times[self.applied] - 1
        # Every later record is appended at the present or after.
        return self.clock - 1

    def new_owner(self) -> None:
        self.stale = self.owner
        worker = self.owner.worker + 1 if self.owner else 1
        claim = self.redis.claim(F, worker)
        wm = Watermarks()
        wm.assign({F: claim}, moved=[F])
        wm.restored([F])
        # The new owner starts at the committed offset: what Redis holds.
        self.owner = Owner(wm, worker, claim.token, self.applied)

    def apply(self, who: Owner, n: int) -> None:
        upto = min(len(self.times), who.position + n)
        if upto == who.position:
            return
        who.position = upto
        self.applied = max(self.applied, upto)
        w = who.wm.applied(F, upto, self.times[upto - 1])
        self.redis.write(F, who.token, w, who.worker)

    def idle(self, who: Owner, before_fetch: int, after_fetch: int) -> None:
        t0 = self.clock
        self.times += [self.clock] * before_fetch  # appended after the clock was read
        end = len(self.times)
        self.times += [self.clock] * after_fetch  # appended after the end was fetched
        w = who.wm.idle(F, t0, end, who.position)
        self.redis.write(F, who.token, w, who.worker)

    def flush(self) -> None:
        """Redis loses everything; the owner notices, claims again, restores its windows.
        A stale owner's writes find its presence mark gone (it would claim again on its
        own loss, which this model leaves out: see streams.marks on a flush during a
        handover)."""
        self.redis.flush()
        self.applied = 0
        self.last_mark = None
        assert self.owner is not None
        claim = self.redis.claim(F, self.owner.worker)
        self.owner.wm.assign({F: claim}, moved=[F])
        self.owner.token = claim.token
        self.applied = self.owner.position  # the restore rewrites what its table holds
        self.owner.wm.restored([F])

    def check(self) -> None:
        mark = self.redis.mark(F)
        if mark is None:
            return
        assert mark <= self.truth(), f"mark {mark} ahead of the truth {self.truth()}"
        if self.last_mark is not None:
            assert mark >= self.last_mark, f"mark moved back {self.last_mark} -> {mark}"
        self.last_mark = mark


step = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4)),
    st.tuples(st.just("tick"), st.sampled_from([0, 1, 2, 50, 40_000])),
    st.tuples(st.just("apply"), st.integers(1, 5)),
    st.tuples(st.just("idle"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("reassign")),
    st.tuples(st.just("stale_apply"), st.integers(1, 5)),
    st.tuples(st.just("stale_idle")),
    st.tuples(st.just("flush")),
)


class TestAgainstTheTruth:
    @given(st.lists(step, max_size=60))
    def test_never_ahead_of_the_truth_and_monotone(self, steps: list[tuple]) -> None:
        world = World()
        world.new_owner()
        for op, *args in steps:
            owner = world.owner
            assert owner is not None
            if op == "append":
                world.times += [world.clock] * args[0]
            elif op == "tick":
                world.clock += args[0]
            elif op == "apply":
                world.apply(owner, args[0])
            elif op == "idle":
                world.idle(owner, args[0], args[1])
            elif op == "reassign":
                world.new_owner()
            elif op == "stale_apply" and world.stale is not None:
                world.apply(world.stale, args[0])
            elif op == "stale_idle" and world.stale is not None:
                world.idle(world.stale, 0, 0)
            elif op == "flush":
                world.flush()
            world.check()

    @given(st.lists(st.integers(0, 3), min_size=1, max_size=20), st.integers(1, 100_000))
    def test_caught_up_and_idle_the_mark_is_the_clock_read_before_the_fetch(
        self, batches: list[int], gap: int
    ) -> None:
        world = World()
        world.new_owner()
        assert world.owner is not None
        for n in batches:
            world.times += [world.clock] * n
            world.apply(world.owner, n)
            world.clock += gap
            world.idle(world.owner, 0, 0)
            assert world.redis.mark(F) == world.clock - 1
            world.check()


class TestIdleGap:
    def test_one_record_after_a_long_idle_gap_does_not_move_the_mark_back(self) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(1, None)}, moved=[])
        # Missing in Redis: held until the end seen now (0) is reached, which it is.
        assert wm.idle(F, 1_000, 0, 0) == 999
        # 40 s of nothing: caught up all along, the mark follows the clock.
        assert wm.idle(F, 41_000, 0, 0) == 40_999
        # Then one record (appended at 41,500) applied before the next idle tick: the mark
        # stays where it was, never back at the record before the gap.
        assert wm.applied(F, 1, 41_500) == 41_499
        assert wm.applied(F, 2, 41_500) is None


class TestHandover:
    def test_a_new_owner_starts_from_the_mark_in_redis_and_never_below_it(self) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(7, 50_000)}, moved=[F])
        # Restoring: nothing claimed, whatever it applies.
        assert wm.applied(F, 10, 60_000) is None
        wm.restored([F])
        assert wm.applied(F, 11, 40_000) is None  # below the mark it found: not written
        assert wm.applied(F, 12, 60_000) == 59_999

    def test_a_partition_whose_mark_is_missing_waits_for_the_end_seen_after_the_claim(
        self,
    ) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(1, None)}, moved=[F])
        wm.restored([F])
        assert wm.applied(F, 5, 1_000) is None  # end not taken yet
        assert wm.idle(F, 2_000, 8, 5) is None  # end taken: 8
        assert wm.applied(F, 7, 1_500) is None
        assert wm.applied(F, 8, 1_600) == 1_599
        assert [h.state for h in wm.health(1_600, 30_000)] == ["vouched"]
        assert [h.state for h in wm.health(40_000, 30_000)] == ["stale"]


class TestKeyed:
    def test_a_keyed_claim_is_the_least_usage_mark_sampled_no_later(self) -> None:
        wm = Watermarks()
        wm.assign({K: Claim(1, 5_000)}, moved=[])
        wm.sample(9_000, [8_000, 7_000])
        wm.sample(10_000, [9_500, 9_000])
        # Caught up at 10,000 (clock read before the fetch): the sample at 10,000 holds.
        assert wm.idle(K, 10_000, 3, 3) == 9_000
        # Behind: applied up to a record appended at 9,500; the sample at 9,000 is the
        # latest no later than 9,499.
        wm2 = Watermarks()
        wm2.assign({K: Claim(1, 5_000)}, moved=[])
        wm2.sample(9_000, [8_000, 7_000])
        wm2.sample(10_000, [9_500, 9_000])
        assert wm2.applied(K, 2, 9_500) == 7_000

    def test_a_usage_mark_missing_from_the_sample_claims_nothing(self) -> None:
        wm = Watermarks()
        wm.assign({K: Claim(1, 5_000)}, moved=[])
        wm.sample(10_000, [9_500, None])
        assert wm.idle(K, 10_000, 3, 3) is None

    def test_a_lost_keyed_mark_takes_its_end_only_once_every_usage_mark_is_back(self) -> None:
        wm = Watermarks()
        wm.assign({K: Claim(1, None)}, moved=[])
        wm.sample(10_000, [9_000, None])
        assert wm.idle(K, 10_000, 20, 20) is None
        wm.sample(11_000, [10_500, 10_400])
        assert wm.idle(K, 11_000, 25, 20) is None  # the end now (25) must be reached
        wm.sample(12_000, [11_500, 11_400])
        assert wm.idle(K, 12_000, 25, 25) == 11_400


class TestPositionHandover:
    def test_a_new_owner_starts_from_the_position_written_with_the_mark(self) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(2, 5_000, position=40)}, moved=[F])
        wm.restored([F])
        # The committed offset (30) lags what the old owner applied (40): caught up anyway.
        assert wm.idle(F, 9_000, 40, 30) == 8_999
        assert wm.position(F) == 40

    def test_a_missing_mark_discards_the_position(self) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(2, None, position=40)}, moved=[F])
        wm.restored([F])
        assert wm.position(F) is None
        assert wm.idle(F, 9_000, 40, 30) is None  # held: the end (40) is not reached


class TestTwoPhase:
    def test_what_a_batch_would_claim_changes_nothing_until_it_is_noted(self) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(1, 1_000, position=5)}, moved=[])
        assert wm.would_apply(F, 8, 2_000) == 1_999
        assert wm.would_apply(F, 8, 2_000) == 1_999  # again: nothing claimed yet
        assert wm.position(F) == 5
        # The batch not noted (its Redis step failed): not caught up with the end (8).
        assert wm.idle(F, 9_000, 8, None) is None
        wm.note_applied(F, 8, 1_999)
        assert wm.position(F) == 8
        assert wm.applied(F, 8, 2_000) is None  # the claim noted is the floor now
        assert wm.idle(F, 9_000, 8, None) == 8_999

    def test_a_claim_noted_under_an_older_token_moves_only_the_position(self) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(1, 1_000, position=5)}, moved=[])
        w = wm.would_apply(F, 8, 2_000)
        wm.assign({F: Claim(2, 1_000, position=5)}, moved=[])  # claimed again meanwhile
        wm.note_applied(F, 8, w, token=1)
        assert wm.position(F) == 8
        assert wm.applied(F, 8, 2_000) == 1_999

    def test_a_hold_is_passed_only_once_noted(self) -> None:
        wm = Watermarks()
        wm.assign({F: Claim(1, None)}, moved=[])
        assert wm.idle(F, 1_000, 8, 5) is None  # the end taken: 8
        assert wm.would_apply(F, 8, 2_000) == 1_999
        assert [h.state for h in wm.health(2_000, 30_000)] == ["held"]
        wm.note_applied(F, 8, 1_999)
        assert [h.state for h in wm.health(2_000, 30_000)] == ["vouched"]
