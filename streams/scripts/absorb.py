"""ABSORB's contract (``absorb.lua``): write windows and absorb their pending reservations.

Per budget key, 7 KEYS and 5 + n ARGV; the reply is the pending amount moved out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spendgate.schemas.luascript import load, optional_arg

__all__ = ["SCRIPT", "AbsorbArgs", "AbsorbKey", "AbsorbReply", "encode_score", "window_px"]

SCRIPT = load("spendgate.streams.scripts", "absorb")


def window_px(window_ms: int) -> int:
    """The PX (ms) of a stored window and its version: idle longer than this, every bucket
    has aged out of the window."""
    return 2 * window_ms


def encode_score(score: float | None) -> str:
    """A utilization score as ARGV: ``""`` for none (the index is left as it is), else six
    decimals."""
    return "" if score is None else f"{score:.6f}"


@dataclass(frozen=True, slots=True)
class AbsorbKey:
    """One budget key's part of an ABSORB call.

    Attributes:
        window_key: the window (``redis_keys.window_key``).
        pending_window_key: the version-1 pending window (hash: a bucket's last ms ->
            amount).
        pending_total_key: the version-2 pending window (the same, plus their sum).
        pending_queue_key: the version-2 pending window's bucket fields (list).
        pending_reservations_key: the version-1 pending reservations (hash: reservation
            id -> :class:`~spendgate.schemas.redis_values.PendingEntry`; version 2 keeps
            them in its own hash, under ``"r:"`` + id).
        version_key: the window's version.
        utilization_key: the utilization index (``redis_keys.utilization_key``).
        window: the encoded window to store, or None to leave it as it is.
        window_ms: the policy's window (the stored value's PX is :func:`window_px`).
        version: the window's version; the window is written only if Redis holds no newer
            one (None: no version, no compare).
        score: the window's utilization, set with the window (None: left as it is).
        reservation_ids: reservations whose reserve the window now holds (or never will:
            late or already settled); their pending amounts leave.
    """

    window_key: str
    pending_window_key: str
    pending_total_key: str
    pending_queue_key: str
    pending_reservations_key: str
    version_key: str
    utilization_key: str
    window: bytes | None
    window_ms: int
    version: int | None = None
    score: float | None = None
    reservation_ids: Sequence[str] = ()

    def keys(self) -> list[str]:
        """This key's 7 KEYS."""
        return [
            self.window_key,
            self.pending_window_key,
            self.pending_total_key,
            self.pending_queue_key,
            self.pending_reservations_key,
            self.version_key,
            self.utilization_key,
        ]

    def argv(self) -> list[bytes | str | int]:
        """This key's 5 + n ARGV."""
        return [
            self.window or b"",
            window_px(self.window_ms),
            optional_arg(self.version),
            encode_score(self.score),
            len(self.reservation_ids),
            *self.reservation_ids,
        ]


@dataclass(frozen=True, slots=True)
class AbsorbArgs:
    """One ABSORB call: its budget keys, each absorbed atomically, in order."""

    budget_keys: Sequence[AbsorbKey]

    def keys(self) -> list[str]:
        """KEYS: each budget key's 7, in order."""
        out: list[str] = []
        for part in self.budget_keys:
            out += part.keys()
        return out

    def argv(self) -> list[bytes | str | int]:
        """ARGV: each budget key's 5 + n, in order."""
        return [a for part in self.budget_keys for a in part.argv()]


@dataclass(frozen=True, slots=True)
class AbsorbReply:
    """What ABSORB did: the pending amount it moved out, over every budget key."""

    moved: int

    @classmethod
    def decode(cls, raw: int | bytes | str) -> AbsorbReply:
        """The script's integer reply."""
        return cls(int(raw))
