"""The worker's cache of decoded key states (streams.statecache)."""

from __future__ import annotations

from spendgate.streams.ledger import KeyState
from spendgate.streams.statecache import StateCache


def state(buckets: int) -> KeyState:
    return KeyState(buckets={i * 1000: 1 for i in range(buckets)}, bucket_ms=1000)


class TestStateCache:
    def test_a_written_state_is_handed_back_as_the_same_object(self) -> None:
        reads: list[str] = []
        cache = StateCache(1_000)
        load = cache.loader(lambda key: reads.append(key) or KeyState())
        kept = state(3)
        cache.put([("a", kept)])
        assert load("a") is kept
        fresh = load("b")
        assert reads == ["b"] and fresh == KeyState()
        assert (cache.hits, cache.misses) == (1, 1)

    def test_the_bound_drops_the_least_recently_written_first(self) -> None:
        cache = StateCache(3 * (8 + 10))
        load = cache.loader(lambda key: KeyState())
        states = {k: state(10) for k in "abcd"}
        cache.put([("a", states["a"]), ("b", states["b"]), ("c", states["c"])])
        cache.put([("a", states["a"])])  # written again: now the newest
        cache.put([("d", states["d"])])
        assert len(cache) == 3
        assert load("b") is not states["b"]  # the oldest went
        assert all(load(k) is states[k] for k in "acd")

    def test_a_state_larger_than_the_bound_is_not_kept(self) -> None:
        cache = StateCache(20)
        cache.put([("big", state(50))])
        assert len(cache) == 0

    def test_an_assignment_forgets_everything(self) -> None:
        cache = StateCache(1_000)
        load = cache.loader(lambda key: KeyState())
        kept = state(1)
        cache.put([("a", kept)])
        cache.forget()
        assert len(cache) == 0 and load("a") is not kept

    def test_zero_turns_it_off(self) -> None:
        cache = StateCache(0)
        cache.put([("a", state(1))])
        assert len(cache) == 0
