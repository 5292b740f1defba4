"""Settings of the stream processor (environment prefix ``SPENDGATE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WorkerSettings(BaseSettings):
    """Everything the worker reads from its environment, built once in the entry point."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    topic_prefix: str = "budget."
    redis_prefix: str = "sg:"
    #: YAML/JSON price catalog for ``cost_usd`` policies (none: only events carrying
    #: ``cost_usd_micros`` can be charged in USD, others follow the policy's ``unpriced``).
    prices_file: Path | None = None
    app_id: str = "spendgate"
    partitions: int = Field(4, ge=1, le=256)
    data_dir: Path = Path.home() / ".local" / "state" / "spendgate" / "tables"
    metrics_port: int = Field(9464, ge=0, le=65535)
    #: How soon a worker that died without leaving its group is noticed (Kafka session
    #: timeout); its partitions move to the others after this.
    session_timeout_s: float = Field(15.0, ge=6.0, le=300.0)
    #: How long past the longest window an event id is remembered for deduplication.
    lateness_ms: int = Field(3_600_000, ge=0)
    #: How far in the future ``occurred_at`` may lie before it is clamped.
    max_future_skew_ms: int = Field(300_000, ge=0)

    def topic(self, name: str) -> str:
        """The full name of one of spendgate's topics (``usage`` -> ``budget.usage``)."""
        return f"{self.topic_prefix}{name}"

    @property
    def keyed_topic(self) -> str:
        """This app's internal topic of usage repartitioned by budget key."""
        return f"{self.topic_prefix}{self.app_id}-keyed"
