"""What one fold batch did: per-key writes, refusals, counts (``streams.fold`` fills them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from spendgate.schemas import window_codec
from spendgate.schemas.alerts import Alert
from spendgate.schemas.overage import OverageMark
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.ledger import KeyState
from spendgate.streams.remote import RemoteBatch

__all__ = ["Counts", "FoldResult", "KeyWrite", "Refusal"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A record for ``budget.dlq``: why, the record's bytes and where it was read."""

    reason: str
    raw: bytes
    topic: Literal["usage", "keyed"]
    partition: int
    offset: int


@dataclass(slots=True)
class KeyWrite:
    """What a batch did to one budget key: its final state and its one Redis write.

    ``changed``: the table value (:meth:`table_value`) must be written (some record
    applied); a key touched by redeliveries only needs its Redis write. The Redis write
    (``streams.materialize.RedisMaterializer.absorb``): :meth:`window` (``None``: leave the
    window as it is), ``absorbed`` reservation ids, ``version`` and ``spec``; due when
    :attr:`redis_due`.
    """

    key: str
    state: KeyState
    spec: WindowSpec
    changed: bool = False
    window_changed: bool = False
    absorbed: dict[str, None] = field(default_factory=dict)
    #: The key's last overage in this batch, for ``overage: cap_next`` (written to Redis).
    overage: OverageMark | None = None
    _encoded: tuple[int, bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def redis_due(self) -> bool:
        """Whether Redis needs a write for this key."""
        return self.window_changed or bool(self.absorbed)

    @property
    def version(self) -> int:
        """The version written beside the window (``KeyState.version``)."""
        return self.state.version

    def table_value(self) -> bytes:
        """The table value (``KeyState.to_bytes``; its window encoded once with Redis's)."""
        width = self.state.bucket_ms
        return self.state.to_bytes(self._window_bytes(width) if width else None)

    def window(self) -> bytes | None:
        """The window for Redis, or ``None`` when no bucket changed over the batch."""
        if not self.window_changed:
            return None
        return self._window_bytes(self.spec.bucket_ms)

    def _window_bytes(self, bucket_ms: int) -> bytes:
        # The table's width (the state's) and Redis's (the spec's) are the same once the
        # key has applied a record: one encoding serves both.
        if self._encoded is None or self._encoded[0] != bucket_ms:
            self._encoded = (bucket_ms, window_codec.encode(self.state.buckets, bucket_ms))
        return self._encoded[1]


@dataclass(slots=True)
class Counts:
    """What the worker's metrics count, for one batch.

    ``events``: usage records by (kind, outcome: counted, duplicate, dead_lettered; kind
    ``invalid`` for records refused whole). ``outcomes``: per-key records by outcome
    (applied, redelivery, late_dropped, too_large).
    """

    events: Counter[tuple[str, str]] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    clamped: int = 0


@dataclass(slots=True)
class FoldResult:
    """One batch's effects, for the worker to write, send and count before it acks.

    ``writes`` per touched key in first-touch order; ``alerts`` and ``refusals`` in event
    order; ``remote``: the keyed topic's messages (:func:`fold_usage` only), ordered by
    source partition, then key by first touch.
    """

    writes: list[KeyWrite]
    alerts: list[Alert]
    refusals: list[Refusal]
    remote: list[RemoteBatch]
    counts: Counts
