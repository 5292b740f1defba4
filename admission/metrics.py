"""Prometheus metrics of the admission service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter(
    "spendgate_admission_decisions_total",
    "Admission answers by decision (allow, cap, downgrade, observe_reject, reject, error, "
    "overloaded).",
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
OVERLOADED = Counter(
    "spendgate_admission_overloaded_total",
    "Redis calls refused as overload (503 overloaded), by reason: queue_full, queue_wait "
    "(no connection slot in time), pool_wait, loop_lag (a timeout while the event loop was "
    "held up).",
    ["reason"],
)
REDIS_CALLS = Gauge(
    "spendgate_admission_redis_calls",
    "Redis calls of this process by state: running (holding a connection) or waiting.",
    ["state"],
)
UNVOUCHED = Counter(
    "spendgate_admission_unvouched_total",
    "Admits touching a budget window its worker did not vouch for, by state and by what "
    "the failure mode made of it (refused, open, degraded).",
    ["state", "mode"],
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
UNPUBLISHED_AT_SHUTDOWN = Counter(
    "spendgate_admission_unpublished_at_shutdown_total",
    "Events still unacknowledged by Kafka when the shutdown wait ran out, by kind "
    "(none of them was answered 202).",
    ["kind"],
)
SETTLEMENTS = Counter(
    "spendgate_admission_settlements_total",
    "Commit and release answers by result: acked (202) or unknown (503, retry safe).",
    ["kind", "result"],
)
CAPPED_NEXT = Counter(
    "spendgate_admission_cap_next_scaled_total",
    "Admits whose estimate was scaled up after an overage (overage: cap_next).",
)
EXTENDS = Counter(
    "spendgate_admission_extends_total",
    "Streaming extends by decision (allow, reject, unvouched)",
    ["decision"],
)
SETTLE_LATENCY = Histogram(
    "spendgate_admission_settle_seconds",
    "Time to answer a commit or release, including the wait for the broker's ack.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
)
RESERVES_REPUBLISHED = Counter(
    "spendgate_admission_reserves_republished_total",
    "Reserve events republished from Redis by the sweeper (unacknowledged past the grace "
    "period, e.g. their admission process died) and acked by the broker.",
)
RESERVES_UNRECOVERABLE = Counter(
    "spendgate_admission_reserves_unrecoverable_total",
    "Unpublished reserves whose reservation record was gone (expired) when swept: "
    "the worker never learned of these reservations.",
)
REFUSALS = Counter(
    "spendgate_admission_refusals_total",
    "Refused admissions handed to the refusals topic, by result: published (acked by the "
    "broker) or dropped (buffer full, send failed, or unsent at shutdown: history is "
    "incomplete there).",
    ["result"],
)
DELAY_WAITING = Gauge(
    "spendgate_admission_delay_waiting",
    "Requests of on_exceed: delay policies this process holds, waiting to fit.",
)
DELAYS = Counter(
    "spendgate_admission_delays_total",
    "Held requests by how their wait ended: admitted, refused (waiting could not help), "
    "queue_full (refused at once), gone (the client disconnected), joined (a repeat of a "
    "request id already waiting).",
    ["result"],
)
CROSS_SHARD = Counter(
    "spendgate_admission_cross_shard_total",
    "Admits whose budget keys span Redis Cluster shards (decided piece by piece)",
)
PIECES_SWEPT = Counter(
    "spendgate_admission_pieces_swept_total",
    "Pieces of cross-shard reservations found past their deadline by a sweeper",
    ["result"],
)
STORE_ERRORS = Counter(
    "spendgate_admission_store_errors_total",
    "Redis errors met by admission's background tasks (unlisting acked reserves, sweeps), "
    "by task; each is retried after a backoff (0.1 s doubling to 5 s), never a dead task.",
    ["task"],
)
