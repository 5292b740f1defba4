"""Prometheus metrics of the admission service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter(
    "spendgate_admission_decisions_total",
    "Admission answers by decision (allow, cap, downgrade, observe_reject, reject, error).",
    ["decision"],
)
LATENCY = Histogram(
    "spendgate_admission_seconds",
    "Time to answer an admit.",
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
STORE_FAILURES = Counter(
    "spendgate_admission_store_failures_total",
    "Redis calls that failed (connection refused, timeout) or were skipped while it is down.",
    ["kind"],
)
FALLBACK_ADMITS = Counter(
    "spendgate_admission_fallback_total",
    "Admits answered without Redis, by failure mode and result.",
    ["mode", "result"],
)
PUBLISH_BUFFER = Gauge(
    "spendgate_admission_publish_buffer_events",
    "Events waiting to be published or awaiting broker acks.",
)
PUBLISH_OVERFLOW = Counter(
    "spendgate_admission_publish_overflow_total",
    "Events that found the publish buffer full, by what was done (refused, admitted).",
    ["action"],
)
PUBLISH_RETRIES = Counter(
    "spendgate_admission_publish_retries_total", "Event sends retried after a failure."
)
