"""The values Redis scripts and Python both read or write, one codec each.

Each codec here has a Lua twin in ``redis_values.lua`` (same names, ``snake_case``), included
by every script that touches the value; a test runs each pair both ways on a real Redis.
The window value itself is :mod:`spendgate.schemas.window_codec` (twin: ``window.lua``).

* **Pending entry**: where one reservation (or extend) sits in a budget key's pending
  window: ``"<field>:<amount>"``, the pending-window field (the last millisecond of the
  bucket it was admitted in, :func:`~spendgate.schemas.window_codec.pending_field`) and the
  amount it added there. Written by ADMIT and EXTEND, read by the worker's ABSORB. It sits
  under the reservation (or extend event) id in the pending reservations hash for the
  version-1 pending window, and under ``PENDING_ENTRY_PREFIX`` + id in the version-2
  pending window's own hash (``redis_keys.pending_total_key``).
* **Stored answer**: the reply of an admit or extend that reserved, kept under the request
  id so a repeat returns it verbatim: the values joined by ``,`` (numbers as exact
  integers). Written by ADMIT and EXTEND, read back by the same scripts.
* **Reservation record**: the hash of one open reservation (``redis_keys.reservation_key``):
  what its reserve event is rebuilt from, and how it was settled. Written by ADMIT, settled
  by SETTLE, checked by EXTEND, read by the reserve sweeper.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from spendgate.schemas.luascript import as_text

__all__ = [
    "PENDING_ENTRY_PREFIX",
    "RECORD_FIELDS",
    "SUBJECT_FIELD",
    "PendingEntry",
    "ReservationRecord",
    "Settled",
    "decode_answer",
    "encode_answer",
]

#: Prefix of a pending entry's field (before the reservation id) in the version-2 pending
#: window's hash.
PENDING_ENTRY_PREFIX = "r:"

#: The reservation record's field holding the subject (JSON).
SUBJECT_FIELD = "subject"
#: The reservation record's fields, as ADMIT writes them (``settled`` is added by SETTLE).
RECORD_FIELDS = (SUBJECT_FIELD, "plan", "usage", "at", "out", "ttl")

#: How a reservation was settled.
Settled = Literal["commit", "release"]


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """One reservation's place in a pending window: its field and the amount it added."""

    field: int
    amount: int

    def encode(self) -> str:
        """``"<field>:<amount>"``."""
        return f"{self.field}:{self.amount}"

    @classmethod
    def decode(cls, raw: bytes | str) -> PendingEntry:
        """Parse an entry written by :meth:`encode` (or by the Lua twin).

        Raises:
            ValueError: not two non-negative integers joined by ``:``.
        """
        field, sep, amount = as_text(raw).partition(":")
        if not (sep and field.isdigit() and amount.isdigit()):
            raise ValueError(f"pending entry: {raw!r} is not '<field>:<amount>'")
        return cls(int(field), int(amount))


def encode_answer(values: Sequence[int | str]) -> str:
    """A stored answer: the values joined by ``,`` (none may contain a comma).

    Raises:
        ValueError: a string value contains a comma or is empty.
    """
    parts = []
    for v in values:
        text = str(v)
        if isinstance(v, str) and (not text or "," in text):
            raise ValueError(f"stored answer: value {v!r} is empty or holds a comma")
        parts.append(text)
    return ",".join(parts)


def decode_answer(raw: bytes | str) -> list[str]:
    """The values of a stored answer, as text (the scripts return them so)."""
    return as_text(raw).split(",")


@dataclass(frozen=True, slots=True)
class ReservationRecord:
    """An open reservation as ADMIT stored it.

    Attributes:
        subject_json: the subject of the reserved plan (after a downgrade: its model).
        plan: the reserved plan's 1-based index.
        usage_json: the estimate as sent (its reserve event is rebuilt from it).
        at_ms: the admission instant (Redis clock).
        max_output_tokens: the capped output, or None when not capped (stored as -1).
        ttl_ms: the longest reservation TTL of the reserved plan (0: the default).
        settled: how it was settled, or None while open.
    """

    subject_json: str
    plan: int
    usage_json: str
    at_ms: int
    max_output_tokens: int | None
    ttl_ms: int
    settled: Settled | None = None

    def encode(self) -> dict[str, str]:
        """The hash's fields, as ADMIT (and SETTLE) write them."""
        out = -1 if self.max_output_tokens is None else self.max_output_tokens
        fields = {
            SUBJECT_FIELD: self.subject_json,
            "plan": str(self.plan),
            "usage": self.usage_json,
            "at": str(self.at_ms),
            "out": str(out),
            "ttl": str(self.ttl_ms),
        }
        if self.settled is not None:
            fields["settled"] = self.settled
        return fields

    @classmethod
    def decode(cls, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> ReservationRecord | None:
        """The record in a hash's fields (``HGETALL``), or None when it is gone (expired)
        or predates a field the reserve event is rebuilt from.

        Raises:
            ValueError: a field holds something ADMIT never writes.
        """
        text = {as_text(k): as_text(v) for k, v in fields.items()}
        if not set(RECORD_FIELDS) <= text.keys():
            return None
        settled = text.get("settled")
        if settled not in (None, "commit", "release"):
            raise ValueError(f"reservation record: settled is {settled!r}")
        out = int(text["out"])
        return cls(
            subject_json=text[SUBJECT_FIELD],
            plan=int(text["plan"]),
            usage_json=text["usage"],
            at_ms=int(text["at"]),
            max_output_tokens=out if out >= 0 else None,
            ttl_ms=int(text["ttl"]),
            settled=settled,  # type: ignore[arg-type]
        )
