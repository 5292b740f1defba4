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

    topic_prefix: str = Field(
        "budget.",
        description="Prefix of every topic spendgate uses: `usage`, `policies`, `alerts`, "
        "`dlq` and `refusals` (`budget.usage`...).",
    )
    redis_prefix: str = Field(
        "sg:", description="Prefix of every Redis key spendgate writes (one deployment each)."
    )
    prices_file: Path | None = Field(
        None,
        description="YAML/JSON price catalog for `cost_usd` policies (none: only events "
        "carrying `cost_usd_micros` can be charged in USD, others follow the policy's "
        "`unpriced`).",
    )
    app_id: str = Field(
        "spendgate",
        description="The worker's consumer group and the name of its changelog and keyed "
        "topics; a new one folds `usage` again from its start.",
    )
    partitions: int = Field(
        4, ge=1, le=256, description="Partitions of the `usage` topic and of the tables."
    )
    data_dir: Path = Field(
        Path.home() / ".local" / "state" / "spendgate" / "tables",
        description="Where the worker keeps its RocksDB tables and dedupe ids; a wiped "
        "folder is rebuilt from the changelog.",
    )
    metrics_port: int = Field(
        9464,
        ge=0,
        le=65535,
        description="Port of the worker's `/metrics`, `/healthz` and `/readyz` (0: off).",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Where `/metrics`, `/healthz` and `/readyz` listen: loopback unless an "
        "orchestrator's probes or a scraper must reach them (they carry no secrets).",
    )
    session_timeout_s: float = Field(
        15.0,
        ge=6.0,
        le=300.0,
        description="How soon a worker that died without leaving its group is noticed "
        "(Kafka session timeout); its partitions move to the others after this.",
    )
    dedupe_horizon: Duration = Field(
        "24h",
        description="How long (arrival time) a producer's event id is remembered: a second "
        "record with the same tenant and id within it changes nothing. Raised to the longest "
        "window unless set explicitly (then a shorter value is kept, with a warning).",
    )
    dedupe_memory_mb: int = Field(
        64,
        ge=4,
        le=65_536,
        description="Memory bound of the on-disk id set (RocksDB block cache + write buffers).",
    )
    retention_margin: Duration = Field(
        "1d",
        description="Retention kept on `usage` beyond the longest window plus the dedupe "
        "horizon, for the topics spendgate creates.",
    )
    drift_keys_per_s: int = Field(
        200,
        ge=0,
        le=100_000,
        description="Drift check: budget windows compared with Redis (and healed) per second; "
        "every key this worker owns is visited once per cycle. 0 turns it off.",
    )
    max_value_bytes: int = Field(
        900_000,
        ge=1_024,
        le=1_000_000,
        description="Largest table value (one key's state) the worker writes; a record that "
        "would make a key's state larger is dead-lettered instead (the changelog's message "
        "limit is 1,000,000 bytes).",
    )
    # Every batch costs a fixed amount besides its records, so a longer linger folds more
    # events per second and a shorter one writes sooner (both measured in bench/RESULTS.md).
    batch_size: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="Records folded together at most (one table value and one Redis write "
        "per key per batch).",
    )
    batch_linger_s: float = Field(
        0.1,
        gt=0,
        le=5.0,
        description="How long a batch's first record waits for more before the batch is "
        "folded anyway (what a record waits at most before its windows are written): lower "
        "is fresher, higher folds more per write.",
    )
    state_cache_items: int = Field(
        2_000_000,
        ge=0,
        description="Key states kept decoded between batches, counted in buckets + "
        "reservations + offsets (about 100 bytes of memory each); 0 turns it off.",
    )
    standby_replicas: int = Field(
        1,
        ge=0,
        le=3,
        description="Standby copies of each table partition kept by other workers (a "
        "handover restores from the standby instead of the whole changelog). Needs that many "
        "more workers.",
    )
    mark_clock_skew_ms: int = Field(
        100,
        ge=0,
        le=60_000,
        description="How far the broker's clock may run behind Redis's (ms): an idle "
        "partition's applied watermark is the Redis clock minus this. 0 on one host; the NTP "
        "bound between the broker's and Redis's hosts otherwise.",
    )
    staleness_s: float = Field(
        30.0,
        gt=0,
        description="Admission's staleness bound (the same setting): the worker's `/readyz` "
        "reports a partition whose mark is older than this as `stale`.",
    )
    max_future_skew_ms: int = Field(
        300_000,
        ge=0,
        description="How far past its broker timestamp an event's `occurred_at` may lie "
        "before it is clamped to the broker timestamp (and counted).",
    )
    worker_kafka_wait_s: float = Field(
        30.0,
        description="The bound on each wait of a batch on Kafka (its sends' acks, its "
        "changelog writes leaving faust's buffer, records read back): past it the batch is "
        "committed again (`spendgate_worker_bound_hits_total`, "
        "`spendgate_worker_resends_total`).",
    )
    worker_stall_s: float = Field(
        45.0,
        description="No progress for this long (an agent holding records, or the event loop "
        "not running) is a stall: `/healthz` answers 503 and says why. At least "
        "`SPENDGATE_WORKER_KAFKA_WAIT_S`.",
    )
    worker_exit_s: float = Field(
        120.0,
        description="No progress for this long ends the process with exit code 4, for its "
        "supervisor to start it again (the records come again from the committed offsets). "
        "Above `SPENDGATE_WORKER_STALL_S`.",
    )
    worker_stop_grace_s: float = Field(
        10.0,
        description="After SIGTERM or SIGINT, how long the worker may take to stop before it "
        "exits anyway (code 4), dropping in-flight work unacked. Below "
        "`SPENDGATE_SESSION_TIMEOUT_S`, so its partitions move no later than a worker that "
        "died would; unset, 10 s, or two thirds of a session timeout of 10 s or less.",
    )

    @model_validator(mode="after")
    def _bounds_in_order(self) -> WorkerSettings:
        if (
            "worker_stop_grace_s" not in self.model_fields_set
            and self.worker_stop_grace_s >= self.session_timeout_s
        ):
            # The default follows a short session timeout instead of refusing it.
            object.__setattr__(
                self, "worker_stop_grace_s", round(self.session_timeout_s * 2 / 3, 3)
            )
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
