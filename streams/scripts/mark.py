"""MARK's contract (``mark.lua``): write applied marks, fenced, while Redis holds this
worker's presence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spendgate.schemas.luascript import load, optional_arg

__all__ = ["SCRIPT", "MarkArgs", "MarkReply", "MarkWrite"]

SCRIPT = load("spendgate.streams.scripts", "mark")


@dataclass(frozen=True, slots=True)
class MarkWrite:
    """One mark for MARK: its owner's token, the watermark (None: leave it), and the
    records its owner is behind (None: unknown)."""

    field: str
    token: int
    watermark_ms: int | None
    behind: int | None = None
    #: The next offset to apply (every record before it is applied in Redis).
    position: int | None = None

    def argv(self) -> list[bytes | str | int]:
        """This mark's 5 ARGV: field, token, watermark, behind, position (``""``: None)."""
        return [
            self.field,
            self.token,
            optional_arg(self.watermark_ms),
            optional_arg(self.behind),
            optional_arg(self.position),
        ]


@dataclass(frozen=True, slots=True)
class MarkArgs:
    """One MARK call.

    Attributes:
        marks_key: the marks (``redis_keys.marks_key``).
        owners_key: the marks' owners (``redis_keys.mark_owners_key``).
        progress_key: the marks' progress (``redis_keys.mark_progress_key``).
        positions_key: the marks' positions (``redis_keys.mark_positions_key``).
        presence_key: this worker's presence mark (gone: nothing is written).
        writes: the marks to write, in order.
    """

    marks_key: str
    owners_key: str
    progress_key: str
    positions_key: str
    presence_key: str
    writes: Sequence[MarkWrite]

    def keys(self) -> list[str]:
        """KEYS: marks, owners, progress, positions, presence."""
        return [
            self.marks_key,
            self.owners_key,
            self.progress_key,
            self.positions_key,
            self.presence_key,
        ]

    def argv(self) -> list[bytes | str | int]:
        """ARGV: each write's 5, in order."""
        return [a for w in self.writes for a in w.argv()]


@dataclass(frozen=True, slots=True)
class MarkReply:
    """What MARK did: whether Redis still held this worker's presence mark, how many marks
    it wrote, and how many writes it refused (a newer owner holds them)."""

    present: bool
    written: int
    fenced: int

    @classmethod
    def decode(cls, raw: Sequence[int | bytes | str]) -> MarkReply:
        """The script's reply ``{present, written, fenced}``."""
        present, written, fenced = (int(x) for x in raw)
        return cls(bool(present), written, fenced)
