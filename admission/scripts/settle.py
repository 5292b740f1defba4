"""SETTLE's contract: commit or release a reservation once (``settle.lua``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from spendgate.schemas.events import Subject
from spendgate.schemas.luascript import as_text, load
from spendgate.schemas.redis_values import Settled

__all__ = ["SCRIPT", "SettleArgs", "SettleResult"]

SCRIPT = load("spendgate.admission.scripts", "settle")


@dataclass(frozen=True, slots=True)
class SettleArgs:
    """Settle the reservation whose record is ``record_key`` as ``kind``."""

    record_key: str
    kind: Settled

    def keys(self) -> list[str]:
        """KEYS, in the script's order."""
        return [self.record_key]

    def argv(self) -> list[str]:
        """ARGV, in the script's order."""
        return [self.kind]


@dataclass(frozen=True, slots=True)
class SettleResult:
    """The record of a settled reservation: ``status`` ok, missing or conflict (then
    ``settled_as`` is how it was settled before)."""

    status: Literal["ok", "missing", "conflict"]
    subject: Subject | None
    settled_as: str | None = None

    @classmethod
    def decode(cls, raw: Sequence[bytes | str]) -> SettleResult:
        """Decode SETTLE's reply."""
        status, subject = (as_text(v) for v in raw)
        if status == "missing":
            return cls("missing", None)
        parsed = Subject.model_validate_json(subject)
        if status.startswith("conflict:"):
            return cls("conflict", parsed, status.removeprefix("conflict:"))
        return cls("ok", parsed)
