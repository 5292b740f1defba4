"""SEAL's contract (``seal.lua``): the commit point of a reservation spanning shards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from spendgate.schemas.luascript import as_text, load
from spendgate.schemas.redis_values import ReservationRecord

__all__ = ["SCRIPT", "SealArgs", "SealReply"]

SCRIPT = load("spendgate.admission.scripts", "seal")


@dataclass(frozen=True, slots=True)
class SealArgs:
    """Seal reservation ``reservation_id`` on its home shard.

    Attributes:
        answer_key, record_key, unpublished_key, tombstone_key, provisional_key,
            piece_key: the home shard's keys (``schemas.redis_keys``; the last two are its
            own piece's, when it has one).
        reservation_id: the reservation.
        answer: the merged answer, encoded (``redis_values.encode_answer``).
        answer_ttl_ms: how long the stored answer lives.
        record: the reservation record to write.
        record_ttl_ms: how long it lives.
    """

    answer_key: str
    record_key: str
    unpublished_key: str
    tombstone_key: str
    provisional_key: str
    piece_key: str
    reservation_id: str
    answer: str
    answer_ttl_ms: int
    record: ReservationRecord
    record_ttl_ms: int

    def keys(self) -> list[str]:
        """KEYS, in the script's order."""
        return [
            self.answer_key,
            self.record_key,
            self.unpublished_key,
            self.tombstone_key,
            self.provisional_key,
            self.piece_key,
        ]

    def argv(self) -> list[str | int]:
        """ARGV, in the script's order."""
        fields = self.record.encode()
        return [
            self.reservation_id,
            self.answer,
            self.answer_ttl_ms,
            *(fields[name] for name in ("subject", "plan", "usage", "at", "out", "ttl")),
            self.record_ttl_ms,
        ]


@dataclass(frozen=True, slots=True)
class SealReply:
    """``status``: sealed, tombstoned (a sweeper aborted it first) or replayed (the
    request id was answered before: ``stored`` holds that answer as ADMIT replays it)."""

    status: Literal["sealed", "tombstoned", "replayed"]
    stored: tuple[bytes | str, ...] = ()

    @classmethod
    def decode(cls, raw: Sequence[bytes | int | str]) -> SealReply:
        """Decode SEAL's reply."""
        code = int(as_text(raw[0]))
        if code == 0:
            return cls("sealed")
        if code == 1:
            return cls("tombstoned")
        return cls("replayed", tuple(v if isinstance(v, bytes) else str(v) for v in raw[1:]))
