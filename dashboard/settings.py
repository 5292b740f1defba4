"""Settings of the dashboard (environment prefix ``SPENDGATE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spendgate.schemas.kafka_connect import KafkaSettings
from spendgate.schemas.redis_connect import RedisSettings
from spendgate.schemas.types import Switch


class DashboardSettings(KafkaSettings, RedisSettings):
    """Everything ``spendgate dashboard`` reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    topic_prefix: str = "budget."
    redis_prefix: str = "sg:"
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = Field(8788, ge=1, le=65535)
    #: The tokens file admission uses (token -> [tenants], "*" or "operator"); none: the
    #: page is open to whoever reaches it, which only a loopback address allows unless
    #: ``allow_unauthenticated``. Mode 600.
    auth_tokens_file: Path | None = None
    #: Listen beyond loopback without a tokens file (whoever reaches it sees every tenant).
    allow_unauthenticated: Switch = False
    #: Where the admission service's and the worker's Prometheus metrics are scraped.
    admission_metrics_url: str = "http://127.0.0.1:8787/metrics"
    worker_metrics_url: str = "http://127.0.0.1:9464/metrics"
    #: How often the metrics are scraped (and refusals per second computed).
    scrape_s: float = Field(1.0, gt=0)
    #: How long a browser session lasts after sign-in.
    session_ttl_s: float = Field(8 * 3600.0, gt=0)
    #: How many of the latest alerts and refusals the page can show.
    feed_size: int = Field(200, ge=1, le=10_000)
    #: Set the session cookie's Secure flag (serve the page behind HTTPS then).
    secure_cookie: bool = False

    def topic(self, name: str) -> str:
        """The full name of one of spendgate's topics (``alerts`` -> ``budget.alerts``)."""
        return f"{self.topic_prefix}{name}"
