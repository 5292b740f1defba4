"""CLAIM_UNPUBLISHED's contract: the reserve sweeper's claim (``claim_unpublished.lua``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spendgate.schemas.luascript import as_text, load, optional_arg

__all__ = ["SCRIPT", "ClaimArgs", "ClaimReply"]

SCRIPT = load("spendgate.admission.scripts", "claim_unpublished")


@dataclass(frozen=True, slots=True)
class ClaimArgs:
    """Claim at most ``most`` entries of ``unpublished_key`` older than ``grace_ms``, or,
    after a sweep's first claim, older than that claim's ``cutoff``."""

    unpublished_key: str
    grace_ms: int
    most: int
    cutoff: int | None = None

    def keys(self) -> list[str]:
        """KEYS, in the script's order."""
        return [self.unpublished_key]

    def argv(self) -> list[int | str]:
        """ARGV, in the script's order."""
        return [self.grace_ms, self.most, optional_arg(self.cutoff)]


@dataclass(frozen=True, slots=True)
class ClaimReply:
    """The sweep's cutoff (Redis clock ms) and the reservation ids claimed, oldest first."""

    cutoff: int
    claimed: tuple[str, ...]

    @classmethod
    def decode(cls, raw: Sequence[bytes | str | int]) -> ClaimReply:
        """Decode CLAIM_UNPUBLISHED's reply."""
        cutoff, *claimed = (as_text(v) for v in raw)
        return cls(int(cutoff), tuple(claimed))
