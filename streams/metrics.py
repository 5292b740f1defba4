"""Prometheus metrics of the stream processor."""

from __future__ import annotations

from prometheus_client import Counter

EVENTS = Counter("spendgate_events_total", "Valid usage events read, by kind.", ["kind"])
OUTCOMES = Counter(
    "spendgate_keyed_records_total",
    "Per-budget-key records applied, by outcome (applied, duplicate, late_dropped).",
    ["outcome"],
)
DEAD_LETTERED = Counter("spendgate_dead_lettered_total", "Records sent to the dead-letter topic.")
