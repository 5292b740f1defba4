"""Settings of the admission service (environment prefix ``SPENDGATE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class AdmissionSettings(BaseSettings):
    """Everything the admission service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    topic_prefix: str = "budget."
    redis_prefix: str = "sg:"
    #: YAML/JSON price catalog for ``cost_usd`` policies (none: only events carrying
    #: ``cost_usd_micros`` can be charged in USD, others follow the policy's ``unpriced``).
    prices_file: Path | None = None
    admission_host: str = "127.0.0.1"
    admission_port: int = Field(8787, ge=1, le=65535)
    auth_tokens_file: Path | None = None
    #: How often the policies materialized in Redis are re-read.
    policy_refresh_s: float = Field(1.0, gt=0)
    #: Events waiting to be published; beyond this, admits are refused with 503.
    publish_buffer: int = Field(10_000, ge=1)

    def topic(self, name: str) -> str:
        """The full name of one of spendgate's topics (``usage`` -> ``budget.usage``)."""
        return f"{self.topic_prefix}{name}"
