"""Settings of the admission service (environment prefix ``SPENDGATE_``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spendgate.schemas.kafka_connect import KafkaSettings
from spendgate.schemas.key_settings import SubjectSecretSettings
from spendgate.schemas.redis_connect import RedisSettings
from spendgate.schemas.types import Switch


class AdmissionSettings(SubjectSecretSettings, KafkaSettings, RedisSettings):
    """Everything the admission service reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    redis_wait_replicas: int = Field(
        1,
        ge=0,
        description="On a cluster, the replicas that must acknowledge a step that holds "
        "(admit, seal, extend) before it is answered, so a failover never loses an answered "
        "reservation; fewer within `SPENDGATE_REDIS_WAIT_MS` is a store failure (the failure "
        "modes answer). 0: answered once the master holds it (a failover may lose the last "
        "moments of reservations).",
    )
    redis_wait_ms: int = Field(
        100,
        ge=1,
        description="How long a step that holds waits for `SPENDGATE_REDIS_WAIT_REPLICAS` "
        "acknowledgements (ms).",
    )
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
    admission_host: str = Field(
        "127.0.0.1",
        description="Where the admission service listens; beyond loopback only with a tokens "
        "file or `SPENDGATE_ALLOW_UNAUTHENTICATED` (`--host`).",
    )
    admission_port: int = Field(8787, ge=1, le=65535, description="The admission service's port.")
    auth_tokens_file: Path | None = Field(
        None,
        description='YAML/JSON mapping bearer token -> list of tenants (or `"*"`, or '
        "`operator`); none: auth is off, which only a loopback address allows unless "
        "`SPENDGATE_ALLOW_UNAUTHENTICATED`. Mode 600, or 640/440.",
    )
    allow_unauthenticated: Switch = Field(
        False,
        description="Listen beyond loopback without a tokens file (whoever reaches it acts "
        "for anyone; `--allow-unauthenticated`).",
    )
    policy_refresh_s: float = Field(
        1.0, gt=0, description="How often the policies materialized in Redis are re-read."
    )
    publish_buffer: int = Field(
        10_000,
        ge=1,
        description="Events waiting to be published or acked; when full, the failure mode decides.",
    )
    refusal_buffer: int = Field(
        10_000,
        ge=1,
        description="Refusals waiting to be published to the refusals topic; one more is "
        "dropped (and counted): refusals never hold up an answer.",
    )
    redis_timeout_s: float = Field(
        0.25,
        gt=0,
        description="Redis socket and connect timeout: a dead Redis must not stall admission.",
    )
    redis_connections: int = Field(
        32,
        ge=1,
        description="Connections to Redis per process: at most this many Redis calls run at once.",
    )
    redis_queue: int = Field(
        1024,
        ge=0,
        description="Redis calls that may wait for a connection beyond those running; one "
        "more is answered 503 `overloaded` (backpressure, never the policy's failure mode).",
    )
    redis_queue_wait_s: float = Field(
        1.0,
        gt=0,
        description="The longest a call waits for a connection before it is answered 503 "
        "`overloaded`.",
    )
    redis_down_s: float = Field(
        0.5,
        ge=0,
        description="After a Redis failure, answer from the failure mode this long before "
        "trying again.",
    )
    ack_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Commit, release and extend answer only once Kafka acked their event; "
        "after this long without an ack they answer 503 `outcome_unknown` (a retry is safe).",
    )
    shutdown_publish_s: float = Field(
        10.0,
        ge=0,
        description="On shutdown, how long unacked events may still take to reach Kafka; "
        "what is left is logged (count per kind, event ids) and counted in a metric.",
    )
    reserve_grace_s: float = Field(
        30.0,
        gt=0,
        description="A reserve event not acknowledged by Kafka this long after its admission "
        "(its process died, or Kafka is down) is republished from Redis by any admission "
        "process; on a cluster, also the deadline of a cross-shard request's pieces "
        "(unsealed past it, a sweeper releases them).",
    )
    reserve_sweep_s: float = Field(
        5.0, gt=0, description="How often each admission process looks for such reserves."
    )
    staleness_s: float = Field(
        30.0,
        gt=0,
        description="A budget window whose worker's applied mark is older than this, on the "
        "Redis clock, is stale: decisions on it follow the policy's failure mode.",
    )
    max_body_bytes: int = Field(
        65_536, ge=1024, description="Larger request bodies are refused with 413."
    )
    delay_waiters: int = Field(
        1000,
        ge=0,
        description="Requests held at once for `on_exceed: delay` policies; one more is "
        "refused at once (429 with a `reason`).",
    )

    def topic(self, name: str) -> str:
        """The full name of one of spendgate's topics (``usage`` -> ``budget.usage``)."""
        return f"{self.topic_prefix}{name}"
