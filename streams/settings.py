"""Settings of the stream processor (environment prefix ``SPENDGATE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from spendgate.schemas.kafka_connect import KafkaSettings
from spendgate.schemas.key_settings import SubjectSecretSettings, settings_error
from spendgate.schemas.redis_connect import RedisSettings
from spendgate.schemas.types import Duration, parse_duration_ms


class WorkerSettings(SubjectSecretSettings, KafkaSettings, RedisSettings):
    """Everything the worker reads from its environment, built once in the entry point."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    topic_prefix: str = "budget."
    redis_prefix: str = "sg:"
    #: YAML/JSON price catalog for ``cost_usd`` policies (none: only events carrying
    #: ``cost_usd_micros`` can be charged in USD, others follow the policy's ``unpriced``).
    prices_file: Path | None = None
    app_id: str = "spendgate"
    partitions: int = Field(4, ge=1, le=256)
    data_dir: Path = Path.home() / ".local" / "state" / "spendgate" / "tables"
    metrics_port: int = Field(9464, ge=0, le=65535)
    #: Where ``/metrics``, ``/healthz`` and ``/readyz`` listen: loopback unless an
    #: orchestrator's probes or a scraper must reach them (they carry no secrets).
    metrics_host: str = "127.0.0.1"
    #: How soon a worker that died without leaving its group is noticed (Kafka session
    #: timeout); its partitions move to the others after this.
    session_timeout_s: float = Field(15.0, ge=6.0, le=300.0)
    #: How long (arrival time) a producer's event id is remembered: a second record with
    #: the same tenant and id within it changes nothing. Raised to the longest window
    #: unless set explicitly (then a shorter value is kept, with a warning).
    dedupe_horizon: Duration = "24h"
    #: Memory bound of the on-disk id set (RocksDB block cache + write buffers).
    dedupe_memory_mb: int = Field(64, ge=4, le=65_536)
    #: Kept on ``usage`` beyond the longest window plus the dedupe horizon.
    retention_margin: Duration = "1d"
    #: Drift check: budget windows compared with Redis (and healed) per second; every key
    #: this worker owns is visited once per cycle. 0 turns it off.
    drift_keys_per_s: int = Field(200, ge=0, le=100_000)
    #: Largest table value (one key's state) the worker writes; a record that would make
    #: a key's state larger is dead-lettered instead (the changelog's message limit is
    #: 1,000,000 bytes).
    max_value_bytes: int = Field(900_000, ge=1_024, le=1_000_000)
    #: Records folded together at most (one table value and one Redis write per key per
    #: batch), and how long a batch's first record waits for more before the batch is
    #: folded anyway (what a record waits at most before its windows are written). Every
    #: batch costs a fixed amount besides its records, so a longer linger folds more
    #: events per second and a shorter one writes sooner (both measured in bench/RESULTS.md).
    batch_size: int = Field(1000, ge=1, le=100_000)
    batch_linger_s: float = Field(0.1, gt=0, le=5.0)
    #: Key states kept decoded between batches (``streams.statecache``), bounded by their
    #: buckets + reservations + offsets (about 100 bytes of memory each); 0 turns it off.
    state_cache_items: int = Field(2_000_000, ge=0)
    #: Standby copies of each table partition kept by other workers (a handover restores
    #: from the standby instead of the whole changelog). Needs that many more workers.
    standby_replicas: int = Field(1, ge=0, le=3)
    #: How far the broker's clock may run behind Redis's (ms): an idle partition's applied
    #: watermark is the Redis clock minus this (streams.marks). 0 on one host; the NTP
    #: bound between the broker's and Redis's hosts otherwise.
    mark_clock_skew_ms: int = Field(100, ge=0, le=60_000)
    #: Admission's staleness bound (the same setting): the worker's ``/readyz`` reports a
    #: partition whose mark is older than this as ``stale``.
    staleness_s: float = Field(30.0, gt=0)
    #: How far in the future ``occurred_at`` may lie before it is clamped.
    max_future_skew_ms: int = Field(300_000, ge=0)
    #: The bound on each wait of a batch on Kafka (its sends' acks, its changelog writes
    #: leaving faust's buffer, records read back): past it the batch is committed again
    #: (``spendgate_worker_bound_hits_total``, ``spendgate_worker_resends_total``).
    worker_kafka_wait_s: float = 30.0
    #: No progress for this long (an agent holding records, or the event loop not running)
    #: is a stall: ``/healthz`` answers 503 and says why. At least the Kafka wait.
    worker_stall_s: float = 45.0
    #: No progress for this long ends the process with exit code 4, for its supervisor to
    #: start it again (the records come again from the committed offsets). Above the
    #: stall bound.
    worker_exit_s: float = 120.0
    #: After SIGTERM or SIGINT, how long the worker may take to stop before it exits
    #: anyway (code 4), dropping in-flight work unacked. Below the session timeout, so its
    #: partitions move no later than a worker that died would.
    worker_stop_grace_s: float = 10.0

    @model_validator(mode="after")
    def _bounds_in_order(self) -> WorkerSettings:
        names = (
            ("worker_kafka_wait_s", "SPENDGATE_WORKER_KAFKA_WAIT_S"),
            ("worker_stall_s", "SPENDGATE_WORKER_STALL_S"),
            ("worker_exit_s", "SPENDGATE_WORKER_EXIT_S"),
            ("worker_stop_grace_s", "SPENDGATE_WORKER_STOP_GRACE_S"),
        )
        for field, env in names:
            if not getattr(self, field) > 0:
                raise ValueError(f"{env} must be above 0 s, got {getattr(self, field)}")
        if self.worker_stall_s < self.worker_kafka_wait_s:
            raise ValueError(
                f"SPENDGATE_WORKER_STALL_S ({self.worker_stall_s}) must be at least "
                f"SPENDGATE_WORKER_KAFKA_WAIT_S ({self.worker_kafka_wait_s}): a wait still "
                "within its bound is no stall"
            )
        if self.worker_exit_s <= self.worker_stall_s:
            raise ValueError(
                f"SPENDGATE_WORKER_EXIT_S ({self.worker_exit_s}) must be above "
                f"SPENDGATE_WORKER_STALL_S ({self.worker_stall_s}): a worker is seen stalled "
                "before it exits"
            )
        if self.worker_stop_grace_s >= self.session_timeout_s:
            raise ValueError(
                f"SPENDGATE_WORKER_STOP_GRACE_S ({self.worker_stop_grace_s}) must be below "
                f"SPENDGATE_SESSION_TIMEOUT_S ({self.session_timeout_s}): a stop must end "
                "before the group would notice a dead worker"
            )
        return self

    def horizon_ms(self, longest_window_ms: int) -> int:
        """The dedupe horizon in force with policies whose longest window is given."""
        configured = parse_duration_ms(self.dedupe_horizon)
        if "dedupe_horizon" in self.model_fields_set:
            return configured
        return max(configured, longest_window_ms)

    def retention_needed_ms(self, longest_window_ms: int) -> int:
        """The least retention ``usage`` needs: longest window plus the dedupe horizon."""
        return longest_window_ms + self.horizon_ms(longest_window_ms)

    def topic(self, name: str) -> str:
        """The full name of one of spendgate's topics (``usage`` -> ``budget.usage``)."""
        return f"{self.topic_prefix}{name}"

    @property
    def keyed_topic(self) -> str:
        """This app's internal topic of usage repartitioned by budget key."""
        return f"{self.topic_prefix}{self.app_id}-keyed"


def load_settings() -> WorkerSettings:
    """The worker's settings from its environment.

    Raises:
        ConfigurationError: a setting is refused (one line naming each variable).
    """
    try:
        return WorkerSettings()
    except ValidationError as exc:
        raise settings_error(exc, "SPENDGATE_") from None
