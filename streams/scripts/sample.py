"""SAMPLE's contract (``sample.lua``): the Redis clock and the usage marks at one instant."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spendgate.schemas.luascript import load, optional_int

__all__ = ["SCRIPT", "SampleArgs", "SampleReply"]

SCRIPT = load("spendgate.streams.scripts", "sample")


@dataclass(frozen=True, slots=True)
class SampleArgs:
    """One SAMPLE call.

    Attributes:
        marks_key: the marks (``redis_keys.marks_key``).
        fields: the usage mark fields read (at least one: ``HMGET`` needs one).

    Raises:
        ValueError: no fields.
    """

    marks_key: str
    fields: Sequence[str]

    def __post_init__(self) -> None:
        if not self.fields:
            raise ValueError("sample: no mark fields (read the clock alone instead)")

    def keys(self) -> list[str]:
        """KEYS: the marks."""
        return [self.marks_key]

    def argv(self) -> list[bytes | str | int]:
        """ARGV: the fields, in order."""
        return list(self.fields)


@dataclass(frozen=True, slots=True)
class SampleReply:
    """What SAMPLE read: the Redis clock (ms) and, per field in order, its mark (None:
    missing)."""

    now_ms: int
    marks: tuple[int | None, ...]

    @classmethod
    def decode(cls, raw: Sequence[int | bytes | str]) -> SampleReply:
        """The script's reply: the clock, then one mark per field (``""``: missing)."""
        return cls(int(raw[0]), tuple(optional_int(m) for m in raw[1:]))
