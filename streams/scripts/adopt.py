"""ADOPT's contract (``adopt.lua``): a copy of the marks takes the tokens CLAIM issued."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spendgate.schemas.luascript import load

__all__ = ["SCRIPT", "AdoptArgs", "AdoptReply"]

SCRIPT = load("spendgate.streams.scripts", "adopt")


@dataclass(frozen=True, slots=True)
class AdoptArgs:
    """One ADOPT call on one copy of the marks.

    Attributes:
        owners_key: the copy's owners (``redis_keys.mark_owners_key`` of its shard).
        presence_key: this worker's presence mark on the copy (set by the call).
        tokens: mark field -> the token CLAIM issued for it.
    """

    owners_key: str
    presence_key: str
    tokens: Mapping[str, int]

    def keys(self) -> list[str]:
        """KEYS: owners, presence."""
        return [self.owners_key, self.presence_key]

    def argv(self) -> list[bytes | str | int]:
        """ARGV: field, token, per field."""
        return [x for field, token in self.tokens.items() for x in (field, token)]


@dataclass(frozen=True, slots=True)
class AdoptReply:
    """The token each field's owner holds on the copy now, in :attr:`AdoptArgs.tokens`
    order (above the one adopted: a newer owner holds it)."""

    held: tuple[int, ...]

    @classmethod
    def decode(cls, raw: Sequence[int | bytes | str]) -> AdoptReply:
        """The script's reply, one token per field."""
        return cls(tuple(int(v) for v in raw))
