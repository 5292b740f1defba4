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

    #: On a cluster, the replicas that must acknowledge a step that holds (admit, seal,
    #: extend) before it is answered, so a failover never loses an answered reservation
    #: (``admission.replicated``); fewer in ``redis_wait_ms`` is a store failure (the
    #: failure modes answer). 0: answered once the master holds it (a failover may lose
    #: the last moments of reservations).
    redis_wait_replicas: int = Field(1, ge=0)
    redis_wait_ms: int = Field(100, ge=1)
    topic_prefix: str = "budget."
    redis_prefix: str = "sg:"
    #: YAML/JSON price catalog for ``cost_usd`` policies (none: only events carrying
    #: ``cost_usd_micros`` can be charged in USD, others follow the policy's ``unpriced``).
    prices_file: Path | None = None
    admission_host: str = "127.0.0.1"
    admission_port: int = Field(8787, ge=1, le=65535)
    #: YAML/JSON mapping bearer token -> list of tenants (or "*"); none: auth is off,
    #: which only a loopback address allows unless ``allow_unauthenticated``. Mode 600.
    auth_tokens_file: Path | None = None
    #: Listen beyond loopback without a tokens file (whoever reaches it acts for anyone).
    allow_unauthenticated: Switch = False
    #: How often the policies materialized in Redis are re-read.
    policy_refresh_s: float = Field(1.0, gt=0)
    #: Events waiting to be published or acked; when full, the failure mode decides.
    publish_buffer: int = Field(10_000, ge=1)
    #: Refusals waiting to be published to ``{prefix}refusals``; one more is dropped
    #: (and counted): refusals never hold up an answer.
    refusal_buffer: int = Field(10_000, ge=1)
    #: Redis socket and connect timeout: a dead Redis must not stall admission.
    redis_timeout_s: float = Field(0.25, gt=0)
    #: Connections to Redis per process: at most this many Redis calls run at once.
    redis_connections: int = Field(32, ge=1)
    #: Redis calls that may wait for a connection beyond those running; one more is
    #: answered 503 ``overloaded`` (backpressure, never the policy's failure mode).
    redis_queue: int = Field(1024, ge=0)
    #: The longest a call waits for a connection before it is answered 503 ``overloaded``.
    redis_queue_wait_s: float = Field(1.0, gt=0)
    #: After a Redis failure, answer from the failure mode this long before trying again.
    redis_down_s: float = Field(0.5, ge=0)
    #: Commit and release answer 202 only once Kafka acked their event; after this long
    #: without an ack they answer 503 (outcome unknown, a retry is safe).
    ack_timeout_s: float = Field(2.0, gt=0)
    #: On shutdown, how long unacked events may still take to reach Kafka; what is left
    #: is logged (count per kind, event ids) and counted in a metric.
    shutdown_publish_s: float = Field(10.0, ge=0)
    #: A reserve event not acknowledged by Kafka this long after its admission (its
    #: process died, or Kafka is down) is republished from Redis by any admission process;
    #: on a cluster, also the deadline of a cross-shard request's pieces (unsealed past it,
    #: a sweeper releases them).
    reserve_grace_s: float = Field(30.0, gt=0)
    #: How often each admission process looks for such reserves.
    reserve_sweep_s: float = Field(5.0, gt=0)
    #: A budget window whose worker's applied mark (``schemas.shards``) is older than
    #: this, on the Redis clock, is stale: decisions on it follow the policy's failure mode.
    staleness_s: float = Field(30.0, gt=0)
    #: Larger request bodies are refused with 413.
    max_body_bytes: int = Field(65_536, ge=1024)
    #: Requests held at once for ``on_exceed: delay`` policies; one more is refused at once.
    delay_waiters: int = Field(1000, ge=0)

    def topic(self, name: str) -> str:
        """The full name of one of spendgate's topics (``usage`` -> ``budget.usage``)."""
        return f"{self.topic_prefix}{name}"
