"""CLAIM's contract (``claim.lua``): a fencing token per mark field, and what Redis holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spendgate.schemas.luascript import load, optional_int
from spendgate.streams.marks import Claim

__all__ = ["SCRIPT", "ClaimArgs", "ClaimReply"]

SCRIPT = load("spendgate.streams.scripts", "claim")


@dataclass(frozen=True, slots=True)
class ClaimArgs:
    """One CLAIM call.

    Attributes:
        owners_key: the marks' owners (``redis_keys.mark_owners_key``).
        marks_key: the marks (``redis_keys.marks_key``).
        positions_key: the marks' positions (``redis_keys.mark_positions_key``).
        presence_key: this worker's presence mark (set by the claim).
        fields: the mark fields claimed.
        generation: the consumer group's generation of this claim (0: none known): tokens
            are ordered by it first, so a claim after a loss of Redis data never fences
            the owner of a newer generation.
    """

    owners_key: str
    marks_key: str
    positions_key: str
    presence_key: str
    fields: Sequence[str]
    generation: int = 0

    def keys(self) -> list[str]:
        """KEYS: owners, marks, positions, presence."""
        return [self.owners_key, self.marks_key, self.positions_key, self.presence_key]

    def argv(self) -> list[bytes | str | int]:
        """ARGV: the generation, then the fields in order."""
        return [self.generation, *self.fields]


@dataclass(frozen=True, slots=True)
class ClaimReply:
    """What CLAIM answered: one :class:`~spendgate.streams.marks.Claim` per field, in the
    order of :attr:`ClaimArgs.fields` (its new token, the mark Redis holds and the position
    written with it; None when missing)."""

    claims: tuple[Claim, ...]

    @classmethod
    def decode(cls, raw: Sequence[int | bytes | str]) -> ClaimReply:
        """The script's flat reply, three values per field.

        Raises:
            ValueError: the reply's length is not a multiple of three.
        """
        if len(raw) % 3:
            raise ValueError(f"claim reply: {len(raw)} values, not three per field")
        claims = []
        for i in range(0, len(raw), 3):
            token, mark, position = raw[i : i + 3]
            claims.append(Claim(int(token), optional_int(mark), optional_int(position)))
        return cls(tuple(claims))
