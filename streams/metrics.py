"""Prometheus metrics of the stream processor."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS = Counter(
    "spendgate_events_total",
    "Usage records read, by kind and outcome (counted, dead_lettered).",
    ["kind", "outcome"],
)
OUTCOMES = Counter(
    "spendgate_keyed_records_total",
    "Per-budget-key records, by outcome (applied, redelivery, late_dropped, too_large).",
    ["outcome"],
)
CLAMPED = Counter(
    "spendgate_clamped_total", "Events whose future occurred_at was clamped to the broker time."
)
DEAD_LETTERED = Counter("spendgate_dead_lettered_total", "Records sent to the dead-letter topic.")
ALERTS = Counter("spendgate_alerts_total", "Alerts emitted, by kind.", ["kind"])
OVERAGES = Counter(
    "spendgate_overage_total",
    "Commits above everything their reservation held (overage alerts), by policy.",
    ["policy"],
)
OVERAGE_AMOUNT = Counter(
    "spendgate_overage_amount_total",
    "Usage committed above reservations (charged at the commit's instant), by policy, in "
    "the policy's unit.",
    ["policy"],
)
LAG = Histogram(
    "spendgate_processing_lag_seconds",
    "From the usage record's broker timestamp to its window being materialized in Redis.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
OFFSET = Gauge(
    "spendgate_consumer_offset",
    "Last offset processed, per topic and partition.",
    ["topic", "partition"],
)
DUPLICATES = Counter(
    "spendgate_duplicate_events_total",
    "Producer duplicates dropped: an event id seen within the dedupe horizon.",
)
DEDUPE_IDS = Gauge(
    "spendgate_dedupe_ids", "Ids in the dedupe set (RocksDB's estimate), all partitions."
)
DEDUPE_REBUILT = Counter(
    "spendgate_dedupe_rebuilt_records_total",
    "Usage records re-read to rebuild the dedupe set after a restart or rebalance.",
)
UNWRITABLE = Counter(
    "spendgate_unwritable_records_total",
    "Records dead-lettered because their effect could not be written (state too large).",
)
RETENTION_SHORT = Gauge(
    "spendgate_usage_retention_short",
    "1 when a policy in force needs more retention on usage than the topic has.",
)
DRIFT_KEYS = Counter(
    "spendgate_drift_keys_total",
    "Budget windows found different in Redis from the worker's table, and healed.",
)
DRIFT_CYCLE = Gauge(
    "spendgate_drift_last_cycle_seconds",
    "How long the last full drift cycle (every key this worker owns) took.",
)
DRIFT_CYCLE_END = Gauge(
    "spendgate_drift_last_cycle_end_timestamp_seconds",
    "When the last full drift cycle ended (Unix time).",
)
REFILLED = Counter(
    "spendgate_skipped_records_refilled_total",
    "Records the stream skipped (a hole in a partition's offsets), read back and handled.",
    ["topic"],
)
MARKS_FENCED = Counter(
    "spendgate_marks_fenced_total",
    "Applied-mark writes Redis refused because a newer owner of the partition holds them.",
)
CARRIED_WRITES = Gauge(
    "spendgate_worker_carried_writes",
    "Table writes Redis may not have (their batch failed before its Redis step confirmed "
    "them), carried to the next batch's Redis step; all agents.",
)
RESTORE_SECONDS = Histogram(
    "spendgate_restore_seconds",
    "How long rewriting the windows of newly assigned partitions (or all, after a loss "
    "of Redis data) into Redis took.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
STORE_ERRORS = Counter(
    "spendgate_worker_store_errors_total",
    "Redis errors met by the worker's agents, timers and tasks, by task; each is retried "
    "after a backoff (0.1 s doubling to 5 s), never a crash.",
    ["task"],
)
UNSENT_ALERTS = Gauge(
    "spendgate_worker_unsent_alerts",
    "Alerts whose crossing is recorded but that the broker has not acked yet; sent again "
    "with every batch until it has (at least once, deterministic ids); all agents.",
)
BOUND_HITS = Counter(
    "spendgate_worker_bound_hits_total",
    "Waits of the worker that hit their bound, by wait: sends (a batch's sends not acked "
    "within SPENDGATE_WORKER_KAFKA_WAIT_S), offsets (its changelog writes not handed to the "
    "producer within it), read_back (records read back from Kafka with none arriving within "
    "it), progress (no progress within SPENDGATE_WORKER_STALL_S: /healthz fails). 0 on a "
    "healthy worker.",
    ["wait"],
)
RESENDS = Counter(
    "spendgate_worker_resends_total",
    "Batches committed again after a Kafka wait hit its bound (sent again under the carried-"
    "write and by-position rules: nothing lost, nothing counted twice). 0 on a healthy worker.",
)
STALLED = Gauge(
    "spendgate_worker_stalled",
    "1 while the worker has made no progress within SPENDGATE_WORKER_STALL_S (/healthz "
    "answers 503); it exits with code 4 after SPENDGATE_WORKER_EXIT_S.",
)
