"""The applied watermark of every partition this worker owns: defined, monotone, fenced (pure).

A mark (``schemas.shards``) tells the admission script that Redis holds every window of one
partition up to a watermark. For partition ``p``:

    W_p = the greatest t such that every record of p with log-append time <= t is applied
          in Redis (its windows written; for keys spanning tenants, its keyed batch acked by
          the broker).

The owner claims W_p from what it knows, never more than is true:

* **applied** (the data path): a batch applied every record of ``p`` before offset ``n``;
  the last of them was appended at ``b``, so every record appended up to ``b - 1`` ms is in
  (log-append times never decrease within a partition; the next record may share ``b``);
* **idle** (the timer): the clock was read (``t0``, Redis time) *before* the end offset
  ``e`` was fetched, and every record before ``e`` is applied: every record appended up to
  ``t0 - 1 - skew`` is in (one appended in the same millisecond after the fetch is not),
  where ``skew`` bounds how far the broker's clock runs behind Redis's;
* a claim never goes below the owner's last one (nor below the mark Redis held when the
  partition was assigned to it: that mark stays true, the windows it vouches for are still
  in Redis), so **W never decreases for one owner**.

A keyed partition (keys spanning tenants) is fed by every usage partition, so its records'
own times are not a watermark of the usage records behind them. Its claim is the *upstream*
watermark: the least usage mark read at an instant ``s`` no later than the keyed claim (every
usage mark read at ``s`` was written after its keyed batches were acked, so those batches
were appended by ``s`` and are applied). The worker samples ``(s, min usage mark)`` in one
atomic read each tick (:meth:`Watermarks.sample`).

Fencing: each assignment of a partition gets a token issued by Redis (greater than every
earlier owner's); the mark script refuses a lower token, or a lower watermark with the same
token, so an owner that lost the partition (paused, then resumed) cannot move the mark.

After Redis lost a partition's mark (a flush, a restart without persistence; or a partition
whose mark was never written) the mark comes back only once the worker restored its windows
and applied every record that was in the partition when it noticed, so the reservations in
flight then (their ``reserve`` not absorbed yet) are counted before anyone decides on the
window. A keyed partition takes its end offset only once every usage mark is back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spendgate.streams.health import PartitionHealth, PartitionState

#: A hold whose end offset is taken at the next idle tick (usage) ...
_TAKE_END = -1
#: ... or once every usage mark is back (keyed).
_AFTER_USAGE = -2

#: Upstream samples kept: a keyed claim older than the oldest one waits for a newer sample.
_SAMPLES = 1024


@dataclass(frozen=True, slots=True)
class Claim:
    """One partition's assignment as Redis answered it: the owner's fencing token, the
    mark Redis held at that instant (None: missing) and the position written with it (every
    record before it is applied in Redis; None: unknown)."""

    token: int
    mark_ms: int | None
    position: int | None = None


@dataclass(slots=True)
class _Owned:
    token: int
    #: The greatest watermark claimed (or found in Redis at the assignment): the floor.
    claimed: int | None
    #: The next offset to apply, when known.
    position: int | None = None
    #: The position to reach before claiming (after a loss), or a _TAKE_END/_AFTER_USAGE.
    hold: int | None = None
    #: The windows are being rewritten into Redis (after the assignment): no claim yet.
    restoring: bool = False
    #: Records behind the end offset at the last idle tick.
    behind: int | None = None


def is_keyed(field: str) -> bool:
    """Whether ``field`` is the mark of a keyed (repartition) partition."""
    return field.startswith("keyed:")


class Watermarks:
    """What this worker may claim for each partition it owns."""

    def __init__(self, skew_ms: int = 0) -> None:
        """Args: skew_ms: how far the broker's clock may run behind the Redis clock."""
        self.skew_ms = skew_ms
        self._owned: dict[str, _Owned] = {}
        #: (Redis ms, least usage mark at that instant or None if one was missing).
        self._samples: deque[tuple[int, int | None]] = deque(maxlen=_SAMPLES)

    # -- assignment ---------------------------------------------------------------------

    def assign(self, claims: Mapping[str, Claim], moved: Iterable[str]) -> None:
        """A new assignment (or a loss of Redis data: every field moved, every mark None).

        Args:
            claims: every owned mark field -> its token and the mark Redis held.
            moved: the fields new to this worker: their windows are rewritten first
                (:meth:`restored`).
        """
        moved = set(moved)
        previous = self._owned
        self._owned = {}
        for field, claim in claims.items():
            before = previous.get(field)
            kept = before if before is not None and claim.mark_ms is not None else None
            floor = _max(claim.mark_ms, kept.claimed if kept else None)
            owned = _Owned(claim.token, floor, restoring=field in moved)
            if claim.mark_ms is None:
                owned.hold = _AFTER_USAGE if is_keyed(field) else _TAKE_END
            else:
                # What the last owner applied is in Redis: no need to apply it again first.
                owned.position = _max(claim.position, kept.position if kept else None)
            self._owned[field] = owned

    def restored(self, fields: Iterable[str]) -> None:
        """The windows behind ``fields`` are rewritten into Redis."""
        for field in fields:
            if (owned := self._owned.get(field)) is not None:
                owned.restoring = False

    def owned(self) -> dict[str, int]:
        """Every owned field -> its fencing token."""
        return {field: o.token for field, o in self._owned.items()}

    def position(self, field: str) -> int | None:
        """The next offset to apply of ``field`` as known here (None: unknown)."""
        owned = self._owned.get(field)
        return None if owned is None else owned.position

    def restoring(self) -> set[str]:
        """The owned fields whose windows are still to be rewritten."""
        return {field for field, o in self._owned.items() if o.restoring}

    # -- claims -------------------------------------------------------------------------

    def sample(self, at_ms: int, usage_marks: Iterable[int | None]) -> None:
        """Every usage mark as Redis held it at ``at_ms`` (one atomic read)."""
        marks = list(usage_marks)
        least = None if not marks or any(m is None for m in marks) else min(marks)  # type: ignore[type-var]
        self._samples.append((at_ms, least))

    def applied(self, field: str, position: int, last_broker_ms: int) -> int | None:
        """The data path: every record before ``position`` is applied, the last of them
        appended at ``last_broker_ms``. Returns the watermark to write, or None.

        :meth:`would_apply` then :meth:`note_applied` in one step."""
        watermark = self.would_apply(field, position, last_broker_ms)
        self.note_applied(field, position, watermark)
        return watermark

    def would_apply(self, field: str, position: int, last_broker_ms: int) -> int | None:
        """The watermark :meth:`applied` would claim, changing nothing: a batch computes
        its marks before Redis has its windows, and notes them (:meth:`note_applied`)
        only once it has them."""
        owned = self._owned.get(field)
        if owned is None:
            return None
        position = max(position, owned.position or 0)
        if is_keyed(field):
            # Usage marks read by Redis no later than this keyed record's append time.
            candidate = self._upstream(last_broker_ms - 1 - self.skew_ms)
        else:
            candidate = last_broker_ms - 1
        return self._would_claim(owned, position, candidate)

    def note_applied(
        self, field: str, position: int, watermark: int | None, token: int | None = None
    ) -> None:
        """Every record of ``field`` before ``position`` is in Redis, and ``watermark``
        (from :meth:`would_apply`; None: none) was sent with it.

        Args:
            field: the mark field.
            position: the next offset to apply.
            watermark: the claim sent; it becomes the floor of the next ones.
            token: the token it was sent with: claimed again meanwhile under another
                token, the position still holds (Redis has the records) but the claim does
                not count for the new one (None: the current token).
        """
        owned = self._owned.get(field)
        if owned is None:
            return
        owned.position = max(position, owned.position or 0)
        if token is None or token == owned.token:
            self._settle(owned, watermark)

    def idle(self, field: str, clock_ms: int, end: int, position: int | None) -> int | None:
        """The timer: the Redis clock read ``clock_ms`` before the end offset ``end`` was
        fetched; ``position``: the next offset to apply as the consumer knows it (the
        committed offset before the first batch). Returns the watermark to write, or None."""
        owned = self._owned.get(field)
        if owned is None:
            return None
        if position is not None:
            owned.position = max(position, owned.position or 0)
        owned.behind = None if owned.position is None else max(0, end - owned.position)
        if owned.hold == _TAKE_END or (owned.hold == _AFTER_USAGE and self._usage_complete()):
            owned.hold = end
        if owned.position is None or owned.position < end:
            return None
        if is_keyed(field):
            # Each usage mark sampled by ``clock_ms`` was written after its keyed batches
            # were acked, so before the end offset was fetched: all of them are applied.
            return self._claim(owned, self._upstream(clock_ms))
        return self._claim(owned, clock_ms - 1 - self.skew_ms)

    def _claim(self, owned: _Owned, candidate: int | None) -> int | None:
        watermark = self._would_claim(owned, owned.position, candidate)
        self._settle(owned, watermark)
        return watermark

    @staticmethod
    def _would_claim(owned: _Owned, position: int | None, candidate: int | None) -> int | None:
        """``candidate`` if ``owned`` at ``position`` may claim it (none of it changed)."""
        if owned.restoring or owned.hold in (_TAKE_END, _AFTER_USAGE):
            return None
        if owned.hold is not None and (position is None or position < owned.hold):
            return None
        if candidate is None or (owned.claimed is not None and candidate <= owned.claimed):
            return None
        return candidate

    @staticmethod
    def _settle(owned: _Owned, watermark: int | None) -> None:
        """``owned`` past its hold (its position reached it), ``watermark`` claimed."""
        if owned.restoring or owned.hold in (_TAKE_END, _AFTER_USAGE):
            return
        if owned.hold is not None:
            if owned.position is None or owned.position < owned.hold:
                return
            owned.hold = None
        if watermark is not None and (owned.claimed is None or watermark > owned.claimed):
            owned.claimed = watermark

    def _usage_complete(self) -> bool:
        return bool(self._samples) and self._samples[-1][1] is not None

    def _upstream(self, at_ms: int) -> int | None:
        """The least usage mark of the latest sample taken no later than ``at_ms``."""
        for sampled_at, least in reversed(self._samples):
            if sampled_at <= at_ms:
                return None if least is None else min(least, at_ms)
        return None

    # -- what it shows ------------------------------------------------------------------

    def health(self, now_ms: int, staleness_ms: int) -> list[PartitionHealth]:
        """Every owned partition for the readiness endpoint, at ``now_ms`` (Redis clock)
        with admission's staleness bound."""
        out = []
        for field, o in sorted(self._owned.items()):
            state: PartitionState = "vouched"
            if o.restoring:
                state = "restoring"
            elif o.hold is not None or o.claimed is None:
                state = "held"
            elif now_ms - o.claimed > staleness_ms:
                state = "stale"
            out.append(PartitionHealth(field, state, o.claimed, o.behind))
        return out


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else max(a, b)
