"""Which applied marks this worker may write now, and their watermarks (pure).

A mark (``schemas.shards``) tells the admission script that Redis holds every window of
one partition, applied up to a watermark. This worker writes the marks of the partitions
it owns every tick:

* caught up (it has handled every record up to the partition's end offset): the
  watermark is the present (``None`` here: the writer takes the Redis clock);
* behind: the broker time of the last record it handled (unknown before its first one
  since the assignment, when nothing is written and the old mark ages into ``stale``).

After Redis lost its data a mark comes back only once the worker restored its windows and
handled every record that was already in the partition when it noticed the loss, so the
reservations in flight then (admitted before the loss, their ``reserve`` not absorbed yet)
are counted again before anyone decides on the window. A keyed partition is fed by every
usage partition, so its end offset is taken only once every usage mark is back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: A keyed partition's hold whose end offset is not taken yet.
_AFTER_USAGE = -1


@dataclass(frozen=True, slots=True)
class Progress:
    """One owned partition as the worker sees it on a tick.

    Attributes:
        position: the next offset to handle (last handled + 1), None when unknown.
        end: the partition's end offset (the offset the next record will get).
        broker_ms: the broker time of the last record handled, None when unknown.
    """

    position: int | None
    end: int
    broker_ms: int | None

    @property
    def caught_up(self) -> bool:
        """Whether every record in the partition has been handled."""
        return self.position is not None and self.position >= self.end


class MarkKeeper:
    """Holds marks back after a loss and says which marks to write on each tick."""

    def __init__(self) -> None:
        #: Mark field -> the position it must reach before it is written again.
        self._held: dict[str, int] = {}

    @property
    def holding(self) -> bool:
        """Whether some mark is held back after a loss."""
        return bool(self._held)

    def lost(self, ends: Mapping[str, int], keyed: Iterable[str]) -> None:
        """Redis lost its data: hold every mark back until its partition's records are in.

        Args:
            ends: usage mark field -> that partition's end offset when the loss was noticed.
            keyed: the keyed mark fields this worker owns (their end offsets are taken once
                every usage mark is back, see :meth:`due`).
        """
        self._held = dict(ends)
        self._held.update({field: _AFTER_USAGE for field in keyed})

    def due(
        self, progress: Mapping[str, Progress], usage_marks_complete: bool
    ) -> dict[str, int | None]:
        """The marks to write now: field -> watermark ms, or None for the present.

        Args:
            progress: every partition this worker owns, by mark field.
            usage_marks_complete: every usage partition's mark is in Redis (whoever owns
                it), so the keyed partitions were fed everything from before the loss.
        """
        out: dict[str, int | None] = {}
        for field, seen in progress.items():
            hold = self._held.get(field)
            if hold == _AFTER_USAGE:
                if not usage_marks_complete:
                    continue
                hold = self._held[field] = seen.end
            if hold is not None:
                if seen.position is None or seen.position < hold:
                    continue
                del self._held[field]
            if seen.caught_up:
                out[field] = None
            elif seen.broker_ms is not None:
                out[field] = seen.broker_ms
        # Partitions this worker no longer owns are no longer its to hold.
        for field in [f for f in self._held if f not in progress]:
            del self._held[field]
        return out
