"""The keyed topic's value: one budget key's events of one fold batch from one source partition.

A key whose counter spans tenants (see ``schemas.shards.tenant_scoped``) is accounted on the
keyed topic, partitioned by budget key. The fold sends it one :class:`RemoteBatch` per
(key, source partition) and batch instead of one message per event: the policy's window
once, then per event only what ``streams.ledger.apply`` needs (producer duplicates were
dropped before). Each entry keeps its own source offset, so the receiving side applies
the entries one by one against the key's per-partition offset watermark: a redelivered
batch changes nothing, and alerts are evaluated per event as everywhere else.

JSON (msgspec), ``v`` 1::

    {"v": 1, "key": str, "policy": str, "window_ms": int, "bucket_ms": int,
     "boundary": "include"|"exclude"|"prorate", "limit": int, "thresholds": [float],
     "src_partition": int, "last_offset": int, "broker_ms": int, "forecast_ms": int,
     "entries": [[src_offset, kind, occurred_ms, amount, reservation_id|null,
                  expires_ms|null, settled, event_id], ...]}

``last_offset`` is the highest source offset covered; ``broker_ms`` the latest broker
timestamp of the records it holds (for the processing-lag metric).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from spendgate.schemas.types import Boundary
from spendgate.streams.ledger import KeyedRecord, Kind, PolicyTerms

__all__ = ["Entry", "RemoteBatch"]

#: One event: (src_offset, kind, occurred_ms, amount, reservation_id, expires_ms, settled,
#: event_id).
Entry = tuple[int, Kind, int, int, str | None, int | None, bool, str]


class RemoteBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One budget key's entries of one batch from one source partition, in offset order."""

    key: str
    policy: str
    window_ms: int
    bucket_ms: int
    boundary: Boundary
    limit: int
    thresholds: tuple[float, ...]
    src_partition: int
    last_offset: int
    broker_ms: int
    entries: tuple[Entry, ...]
    #: The policy's forecast alert horizon (0: none); absent in batches of older workers.
    forecast_ms: int = 0
    v: Literal[1] = 1

    def to_bytes(self) -> bytes:
        """The keyed topic's value."""
        return _ENCODER.encode(self)

    @classmethod
    def from_bytes(cls, raw: bytes) -> RemoteBatch:
        """Inverse of :meth:`to_bytes`.

        Raises:
            ValueError: ``raw`` is not a version-1 batch; the message says where.
        """
        try:
            return _DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not a keyed batch: {exc}") from exc

    def records(self) -> list[KeyedRecord]:
        """The entries as the records ``streams.ledger.apply`` takes, in order."""
        terms = PolicyTerms(
            self.policy,
            self.window_ms,
            self.bucket_ms,
            self.limit,
            self.boundary,
            self.thresholds,
            self.forecast_ms,
        )
        return [
            terms.record(
                self.key,
                event_id=event_id,
                kind=kind,
                occurred_ms=occurred_ms,
                amount=amount,
                src_partition=self.src_partition,
                src_offset=offset,
                reservation_id=rid,
                expires_ms=expires_ms,
                settled=settled,
                broker_ms=self.broker_ms,
            )
            for offset, kind, occurred_ms, amount, rid, expires_ms, settled, event_id in (
                self.entries
            )
        ]


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(RemoteBatch)
