"""Settings of the dashboard (environment prefix ``SPENDGATE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.kafka_connect import KafkaSettings
from spendgate.schemas.key_settings import secret_or_file
from spendgate.schemas.redis_connect import RedisSettings
from spendgate.schemas.types import Switch


class DashboardSettings(KafkaSettings, RedisSettings):
    """Everything ``spendgate dashboard`` reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    topic_prefix: str = Field(
        "budget.",
        description="Prefix of every topic spendgate uses (the dashboard reads `alerts` and "
        "`refusals`).",
    )
    redis_prefix: str = Field(
        "sg:", description="Prefix of every Redis key spendgate writes (one deployment each)."
    )
    dashboard_host: str = Field(
        "127.0.0.1",
        description="Where the dashboard listens; beyond loopback only with a tokens file or "
        "`SPENDGATE_ALLOW_UNAUTHENTICATED` (`--host`).",
    )
    dashboard_port: int = Field(8788, ge=1, le=65535, description="The dashboard's port.")
    auth_tokens_file: Path | None = Field(
        None,
        description='The tokens file admission uses (token -> [tenants], `"*"` or '
        "`operator`); none: the page is open to whoever reaches it, which only a loopback "
        "address allows unless `SPENDGATE_ALLOW_UNAUTHENTICATED`. Mode 600, or 640/440.",
    )
    allow_unauthenticated: Switch = Field(
        False,
        description="Listen beyond loopback without a tokens file (whoever reaches it sees "
        "every tenant; `--allow-unauthenticated`).",
    )
    admission_metrics_url: str = Field(
        "http://127.0.0.1:8787/metrics",
        description="Where the admission service's Prometheus metrics are scraped.",
    )
    worker_metrics_url: str = Field(
        "http://127.0.0.1:9464/metrics",
        description="Where the worker's Prometheus metrics are scraped.",
    )
    scrape_s: float = Field(
        1.0,
        gt=0,
        description="How often the metrics are scraped (and refusals per second computed).",
    )
    session_ttl_s: float = Field(
        8 * 3600.0, gt=0, description="How long a browser session lasts after sign-in."
    )
    dashboard_session_secret: SecretStr | None = Field(
        None,
        description="The HMAC key that signs the dashboard's session cookies (at least 16 "
        "bytes; every replica must share it, so that a session survives a restart and works "
        "on any of them); or `SPENDGATE_DASHBOARD_SESSION_SECRET_FILE`. Neither, with a "
        "tokens file: refused beyond loopback; on loopback a random one, sessions ending with "
        "the process.",
    )
    dashboard_session_secret_file: Path | None = Field(
        None,
        description="A file holding the session secret (mode 600, 640, 400 or 440: others "
        "may not read it; surrounding whitespace ignored).",
    )
    feed_size: int = Field(
        200,
        ge=1,
        le=10_000,
        description="How many of the latest alerts and refusals the page can show.",
    )
    secure_cookie: bool = Field(
        False,
        description="Set the session cookie's Secure flag (serve the page behind HTTPS then).",
    )

    def session_secret(self) -> bytes | None:
        """The session secret, or None for neither setting.

        Raises:
            ConfigurationError: both are set, the file is unreadable or shared, or the
                secret is shorter than 16 bytes.
        """
        variable = "SPENDGATE_DASHBOARD_SESSION_SECRET"
        found = secret_or_file(
            self.dashboard_session_secret, self.dashboard_session_secret_file, variable
        )
        if found is None:
            return None
        secret = found.get_secret_value().strip().encode()
        if len(secret) < 16:
            raise ConfigurationError(
                f"{variable}: the session secret must be at least 16 bytes (generate one: "
                "python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        return secret

    def topic(self, name: str) -> str:
        """The full name of one of spendgate's topics (``alerts`` -> ``budget.alerts``)."""
        return f"{self.topic_prefix}{name}"
