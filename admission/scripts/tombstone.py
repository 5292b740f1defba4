"""TOMBSTONE's contract (``tombstone.lua``): a piece past its deadline, sealed or aborted."""

from __future__ import annotations

from dataclasses import dataclass

from spendgate.schemas.luascript import load

__all__ = ["SCRIPT", "TombstoneArgs"]

SCRIPT = load("spendgate.admission.scripts", "tombstone")


@dataclass(frozen=True, slots=True)
class TombstoneArgs:
    """Decide reservation ``record_key``'s fate on its home shard: sealed (the reply is
    1) or aborted by ``tombstone_key``, which lives ``ttl_ms`` (the reply is 0)."""

    record_key: str
    tombstone_key: str
    ttl_ms: int

    def keys(self) -> list[str]:
        """KEYS, in the script's order."""
        return [self.record_key, self.tombstone_key]

    def argv(self) -> list[int]:
        """ARGV, in the script's order."""
        return [self.ttl_ms]
