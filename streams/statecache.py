"""Recently folded key states, kept decoded between batches.

The fold changes a key's :class:`~streams.ledger.KeyState` in place and the worker writes
its bytes to the table; the next batch that touches the key would read those bytes back
and decode them. This cache hands the next batch the same object instead.

A state enters it in the same synchronous step as its table write (the fold and the
write have no ``await`` between them), so it is exactly as new as the table. It is
emptied on every partition assignment: a partition that leaves this worker may come back
changed by another one. Its size is bounded by the states' items (buckets, reservations,
offsets), least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from spendgate.streams.ledger import KeyState

__all__ = ["StateCache"]

#: Items a state costs besides its buckets, reservations and offsets.
_BASE_ITEMS = 8


def _items(state: KeyState) -> int:
    return _BASE_ITEMS + len(state.buckets) + len(state.reservations) + len(state.offsets)


class StateCache:
    """Decoded key states, LRU, bounded by their items.

    Args:
        max_items: the most buckets + reservations + offsets (+ 8 per key) kept; 0 turns
            the cache off.
    """

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self._states: OrderedDict[str, tuple[KeyState, int]] = OrderedDict()
        self._items = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._states)

    def loader(self, read: Callable[[str], KeyState]) -> Callable[[str], KeyState]:
        """A fold ``load``: the cached state, else ``read(key)`` (the table)."""

        def load(key: str) -> KeyState:
            held = self._states.get(key)
            if held is None:
                self.misses += 1
                return read(key)
            self.hits += 1
            return held[0]

        return load

    def put(self, states: Iterable[tuple[str, KeyState]]) -> None:
        """Keep states just written to the table."""
        if not self.max_items:
            return
        for key, state in states:
            items = _items(state)
            old = self._states.pop(key, None)
            if old is not None:
                self._items -= old[1]
            if items > self.max_items:
                continue
            self._states[key] = (state, items)
            self._items += items
        while self._items > self.max_items:
            _, (_, items) = self._states.popitem(last=False)
            self._items -= items

    def forget(self) -> None:
        """Drop everything (partitions were assigned: states may have moved)."""
        self._states.clear()
        self._items = 0
