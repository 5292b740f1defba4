"""EXTEND's contract: its KEYS and ARGV built by role, its reply decoded (``extend.lua``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spendgate.admission.scripts.admit import KeyState
from spendgate.admission.scripts.codes import EXTEND_OUTCOMES, ExtendOutcome
from spendgate.schemas.luascript import load

__all__ = ["SCRIPT", "ExtendArgs", "ExtendResult", "ExtendTarget"]

SCRIPT = load("spendgate.admission.scripts", "extend")

ArgValue = int | str


@dataclass(frozen=True, slots=True)
class ExtendTarget:
    """One budget key the reservation holds, with the amount to grow it by.

    ``failure`` is the policy's failure mode code (``codes.FAILURE_MODES``); ``deps`` the
    mark indexes (1-based, into :attr:`ExtendArgs.marks`) its window depends on, joined by
    ``,`` (``admit.encode_deps``); ``reservation_ttl_ms`` when this hold expires if nobody
    absorbs it (``key_steps.lua``, "Expiry").
    """

    held_keys: tuple[str, ...]
    limit: int
    window_ms: int
    bucket_ms: int
    boundary: str
    amount: int
    observe: bool
    failure: int
    deps: str
    reservation_ttl_ms: int


@dataclass(frozen=True, slots=True)
class ExtendArgs:
    """One EXTEND call.

    Attributes:
        answer_key: the extend's stored answer (one per reservation and sequence number).
        record_key: the reservation record.
        marks_key: the applied marks.
        entry: the extend's event id, the name of its pending entry.
        answer_ttl_ms: how long the stored answer lives.
        staleness_ms: a mark older than this is stale.
        marks: the mark fields the targets' ``deps`` refer to.
        targets: every key the reservation holds.
        mode: ``""`` an extend on one shard; ``"piece"`` one shard's part of an extend
            spanning shards (nothing read or stored but the holds); ``"seal" + answer``
            on the home shard, no targets: the record checked, ``answer`` (the merged
            one, ``redis_values.encode_answer``) stored (``admission.pieces``).
    """

    answer_key: str
    record_key: str
    marks_key: str
    entry: str
    answer_ttl_ms: int
    staleness_ms: int
    marks: tuple[str, ...]
    targets: tuple[ExtendTarget, ...]
    mode: str = ""

    def keys(self) -> list[str]:
        """KEYS, in the script's order."""
        keys = [self.answer_key, self.record_key, self.marks_key]
        for t in self.targets:
            keys += t.held_keys
        return keys

    def argv(self) -> list[ArgValue]:
        """ARGV, in the script's order."""
        args: list[ArgValue] = [self.entry, self.answer_ttl_ms, self.staleness_ms]
        args += (len(self.marks), *self.marks, len(self.targets))
        for t in self.targets:
            args += (
                t.limit,
                t.window_ms,
                t.bucket_ms,
                t.boundary,
                t.amount,
                int(t.observe),
                t.failure,
                t.deps,
                t.reservation_ttl_ms,
            )
        if self.mode:
            args.append(self.mode)
        return args


@dataclass(frozen=True, slots=True)
class ExtendResult:
    """What the extend script decided: ``now_ms`` is the extend's instant (Redis clock;
    the first answer's, for a repeat), ``keys`` one state per target, in order."""

    replayed: bool
    outcome: ExtendOutcome
    now_ms: int
    keys: tuple[KeyState, ...]

    @classmethod
    def decode(cls, raw: Sequence[bytes | int | str]) -> ExtendResult:
        """Decode EXTEND's reply (fresh or a stored answer replayed)."""
        replayed, outcome, now_ms, n, *rest = raw
        states = KeyState.decode_all(rest, int(n))
        return cls(bool(int(replayed)), EXTEND_OUTCOMES[int(outcome)], int(now_ms), states)

    def answer_values(self) -> list[int | str]:
        """The values EXTEND stores as this answer (its reply without ``replayed``)."""
        code = {name: c for c, name in EXTEND_OUTCOMES.items()}[self.outcome]
        values: list[int | str] = [code, self.now_ms, len(self.keys)]
        for key in self.keys:
            values += key.values()
        return values
