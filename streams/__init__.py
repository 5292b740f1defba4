"""The stream processor: faust agents keeping per-budget-key windows, materialized to Redis."""

from __future__ import annotations

from spendgate.streams.ledger import Change, KeyedRecord, KeyState, apply, keyed_record
from spendgate.streams.settings import WorkerSettings

__all__ = ["Change", "KeyState", "KeyedRecord", "WorkerSettings", "apply", "keyed_record"]
