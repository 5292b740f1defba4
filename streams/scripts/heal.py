"""HEAL's contract (``heal.lua``): rewrite one window that drifted, never over a newer one."""

from __future__ import annotations

from dataclasses import dataclass

from spendgate.schemas.luascript import load
from spendgate.streams.scripts.absorb import encode_score, window_px

__all__ = ["SCRIPT", "HealArgs", "HealReply"]

SCRIPT = load("spendgate.streams.scripts", "heal")


@dataclass(frozen=True, slots=True)
class HealArgs:
    """One HEAL call.

    Attributes:
        window_key: the window (``redis_keys.window_key``).
        version_key: the window's version (``redis_keys.window_version_key``).
        utilization_key: the utilization index (``redis_keys.utilization_key``).
        window: the window as the worker's table holds it (encoded).
        window_ms: the policy's window (the stored value's PX is
            :func:`~spendgate.streams.scripts.absorb.window_px`).
        version: the window's version.
        score: its utilization, set with the window (None: the index is left as it is).
    """

    window_key: str
    version_key: str
    utilization_key: str
    window: bytes
    window_ms: int
    version: int
    score: float | None = None

    def keys(self) -> list[str]:
        """KEYS: the window, its version, the utilization index."""
        return [self.window_key, self.version_key, self.utilization_key]

    def argv(self) -> list[bytes | str | int]:
        """ARGV: the window, its PX, its version, its score."""
        return [self.window, window_px(self.window_ms), self.version, encode_score(self.score)]


@dataclass(frozen=True, slots=True)
class HealReply:
    """What HEAL did: whether it rewrote the window (False: it matched, or Redis holds a
    newer one)."""

    rewritten: bool

    @classmethod
    def decode(cls, raw: int | bytes | str) -> HealReply:
        """The script's reply, 1 or 0."""
        return cls(bool(int(raw)))
