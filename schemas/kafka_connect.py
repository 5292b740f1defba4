"""The one Kafka connection setting (security and replication) and the only place Kafka
clients are built: every aiokafka producer, consumer and admin client, and the faust app.

Settings (environment prefix ``SPENDGATE_KAFKA_``, read by :class:`KafkaSettings`, which
every service's settings class includes)::

    BOOTSTRAP               host:port[,host:port...]
    SECURITY_PROTOCOL       PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    SASL_MECHANISM          PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    SASL_USERNAME
    SASL_PASSWORD           or SASL_PASSWORD_FILE (mode 600/640/400/440)
    SSL_CAFILE              CA bundle (PEM) trusted for the brokers' certificates
    SSL_CERTFILE            client certificate (PEM), when the brokers ask for one
    SSL_KEYFILE             its private key (PEM)
    SSL_KEY_PASSWORD        or SSL_KEY_PASSWORD_FILE (mode 600/640/400/440)
    REPLICATION_FACTOR      of every topic spendgate (or faust) creates; 3 in production
    MIN_INSYNC_REPLICAS     of those topics; 2 in production (with acks=all)
    ALLOW_UNDER_REPLICATED  start even when an existing topic has less (a warning)

Secrets are :class:`~pydantic.SecretStr`: their ``repr`` and ``str`` show ``**********``;
only the client factories read the values.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.helpers import create_ssl_context
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.key_settings import readable_files, secret_or_file, settings_error
from spendgate.schemas.types import Switch

if TYPE_CHECKING:
    import faust
    from faust.auth import Credentials

__all__ = [
    "KafkaConnection",
    "KafkaSettings",
    "SaslMechanism",
    "SecurityProtocol",
    "TopicReplication",
    "admin",
    "check",
    "consumer",
    "explain",
    "faust_app",
    "producer",
    "shortfalls",
]


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


SecurityProtocol = Annotated[
    Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"], BeforeValidator(_upper)
]
SaslMechanism = Annotated[
    Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"], BeforeValidator(_upper)
]

_ENV = "SPENDGATE_KAFKA_"


class KafkaConnection(BaseModel):
    """How every client reaches Kafka, and the replication of the topics it creates.

    Built by :meth:`KafkaSettings.kafka` from the environment (or directly in tests);
    a combination that cannot connect is refused with a message naming the variable.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_key_password: SecretStr | None = None
    replication_factor: int = Field(1, ge=1)
    min_insync_replicas: int = Field(1, ge=1)
    allow_under_replicated: bool = False

    @property
    def uses_sasl(self) -> bool:
        """Whether the protocol authenticates with SASL."""
        return self.security_protocol.startswith("SASL_")

    @property
    def uses_ssl(self) -> bool:
        """Whether the protocol encrypts with TLS."""
        return self.security_protocol in ("SSL", "SASL_SSL")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        protocol = f"{_ENV}SECURITY_PROTOCOL={self.security_protocol}"
        if self.uses_sasl:
            if self.sasl_mechanism is None:
                raise ValueError(
                    f"{protocol} needs {_ENV}SASL_MECHANISM (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)"
                )
            if not self.sasl_username:
                raise ValueError(f"{protocol} needs {_ENV}SASL_USERNAME")
            if self.sasl_password is None:
                raise ValueError(
                    f"{protocol} needs {_ENV}SASL_PASSWORD or {_ENV}SASL_PASSWORD_FILE"
                )
        else:
            for name in ("sasl_mechanism", "sasl_username", "sasl_password"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{_ENV}{name.upper()} is set but {protocol} does not use SASL "
                        "(use SASL_PLAINTEXT or SASL_SSL)"
                    )
        if not self.uses_ssl:
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_key_password"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{_ENV}{name.upper()} is set but {protocol} does not use TLS "
                        "(use SSL or SASL_SSL)"
                    )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(f"set both {_ENV}SSL_CERTFILE and {_ENV}SSL_KEYFILE, or neither")
        if self.ssl_key_password is not None and self.ssl_keyfile is None:
            raise ValueError(f"{_ENV}SSL_KEY_PASSWORD is set without {_ENV}SSL_KEYFILE")
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"{_ENV}MIN_INSYNC_REPLICAS ({self.min_insync_replicas}) exceeds "
                f"{_ENV}REPLICATION_FACTOR ({self.replication_factor}): no acks=all write "
                "could ever succeed"
            )
        return self

    def check_files(self) -> Self:
        """Refuse TLS files that are missing or unreadable (before any client tries them).

        Raises:
            ConfigurationError: naming the variable and the file.
        """
        names = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
        readable_files((f"{_ENV}{name.upper()}", getattr(self, name)) for name in names)
        return self

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of the clients (None without TLS): the CA file's certificates
        are trusted (the system's without one), the client certificate sent when set."""
        if not self.uses_ssl:
            return None
        password = self.ssl_key_password.get_secret_value() if self.ssl_key_password else None
        context: ssl.SSLContext = create_ssl_context(
            cafile=self.ssl_cafile,
            certfile=self.ssl_certfile,
            keyfile=self.ssl_keyfile,
            password=password,
        )
        return context

    def aiokafka_kwargs(self) -> dict[str, Any]:
        """The security keyword arguments of ``AIOKafkaProducer``, ``AIOKafkaConsumer`` and
        ``AIOKafkaAdminClient`` (``bootstrap_servers`` excepted)."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_ssl:
            kwargs["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            assert self.sasl_password is not None  # checked by the validator
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password.get_secret_value()
        return kwargs

    def faust_credentials(self) -> Credentials | None:
        """faust's ``broker_credentials``, which faust-streaming maps to the same aiokafka
        arguments for its producers, consumers and topic creation (None: PLAINTEXT)."""
        from faust.auth import SASLCredentials, SSLCredentials

        if self.uses_sasl:
            assert self.sasl_password is not None  # checked by the validator
            # With a context faust sets SASL_SSL, without one SASL_PLAINTEXT.
            return SASLCredentials(
                username=self.sasl_username,
                password=self.sasl_password.get_secret_value(),
                ssl_context=self.ssl_context(),
                mechanism=self.sasl_mechanism,
            )
        if self.uses_ssl:
            return SSLCredentials(self.ssl_context())
        return None

    def topic_configs(self) -> dict[str, str]:
        """The configs every topic spendgate creates carries for durability."""
        return {"min.insync.replicas": str(self.min_insync_replicas)}


class KafkaSettings(BaseSettings):
    """The ``SPENDGATE_KAFKA_*`` settings, shared by every service's settings class."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    kafka_bootstrap: str = Field(
        "127.0.0.1:9092", description="The brokers to bootstrap from: `host:port[,host:port...]`."
    )
    kafka_security_protocol: SecurityProtocol = Field(
        "PLAINTEXT", description="How clients connect to the brokers."
    )
    kafka_sasl_mechanism: SaslMechanism | None = Field(
        None, description="The SASL mechanism (needed with `SASL_PLAINTEXT` and `SASL_SSL`)."
    )
    kafka_sasl_username: str | None = Field(None, description="The SASL user (needed with SASL).")
    kafka_sasl_password: SecretStr | None = Field(
        None,
        description="The SASL password (with SASL, this or `SPENDGATE_KAFKA_SASL_PASSWORD_FILE`"
        "); never logged.",
    )
    kafka_sasl_password_file: Path | None = Field(
        None,
        description="A file holding the SASL password (mode 600, 640, 400 or 440: others may not "
        "read it; surrounding whitespace ignored).",
    )
    kafka_ssl_cafile: Path | None = Field(
        None,
        description="PEM bundle trusted for the brokers' certificates (none: the system's CAs).",
    )
    kafka_ssl_certfile: Path | None = Field(
        None, description="Client certificate (PEM), when the brokers ask for one."
    )
    kafka_ssl_keyfile: Path | None = Field(None, description="The client certificate's key (PEM).")
    kafka_ssl_key_password: SecretStr | None = Field(
        None, description="The client key's password, if it has one; never logged."
    )
    kafka_ssl_key_password_file: Path | None = Field(
        None,
        description="A file holding the client key's password (mode 600, 640, 400 or 440: "
        "others may not read it; surrounding whitespace ignored).",
    )
    kafka_replication_factor: int = Field(
        1,
        ge=1,
        description="Replicas of every topic created, faust's changelogs included (production: 3).",
    )
    kafka_min_insync_replicas: int = Field(
        1,
        ge=1,
        description="`min.insync.replicas` of those topics (production: 2): with `acks=all` "
        "an acknowledged record is then on two brokers' disks.",
    )
    kafka_allow_under_replicated: Switch = Field(
        False,
        description="Start although an existing topic has fewer replicas than asked (a "
        "warning instead of a refusal).",
    )

    def kafka(self) -> KafkaConnection:
        """The connection these settings describe (secret files are read on each call:
        a copy of the settings with other values never answers a stale connection).

        Raises:
            ConfigurationError: a bad combination, both a secret and its file, an
                unreadable or shared secret file, or a missing TLS file.
        """
        try:
            connection = KafkaConnection(
                bootstrap=self.kafka_bootstrap,
                security_protocol=self.kafka_security_protocol,
                sasl_mechanism=self.kafka_sasl_mechanism,
                sasl_username=self.kafka_sasl_username,
                sasl_password=secret_or_file(
                    self.kafka_sasl_password,
                    self.kafka_sasl_password_file,
                    f"{_ENV}SASL_PASSWORD",
                ),
                ssl_cafile=self.kafka_ssl_cafile,
                ssl_certfile=self.kafka_ssl_certfile,
                ssl_keyfile=self.kafka_ssl_keyfile,
                ssl_key_password=secret_or_file(
                    self.kafka_ssl_key_password,
                    self.kafka_ssl_key_password_file,
                    f"{_ENV}SSL_KEY_PASSWORD",
                ),
                replication_factor=self.kafka_replication_factor,
                min_insync_replicas=self.kafka_min_insync_replicas,
                allow_under_replicated=self.kafka_allow_under_replicated,
            )
        except ValidationError as exc:
            raise settings_error(exc) from None
        return connection.check_files()


@dataclass(frozen=True, slots=True)
class TopicReplication:
    """An existing topic's replication as the broker describes it."""

    topic: str
    replication_factor: int
    min_insync_replicas: int


def shortfalls(found: Iterable[TopicReplication], kafka: KafkaConnection) -> list[str]:
    """One line per topic replicated less than ``kafka`` asks (its name, what it has and
    what is wanted, and how to fix it); empty when every topic has enough."""
    lines = []
    for t in found:
        short = []
        if t.replication_factor < kafka.replication_factor:
            short.append(
                f"replication factor {t.replication_factor} < {kafka.replication_factor} "
                f"({_ENV}REPLICATION_FACTOR)"
            )
        if t.min_insync_replicas < kafka.min_insync_replicas:
            short.append(
                f"min.insync.replicas {t.min_insync_replicas} < {kafka.min_insync_replicas} "
                f"({_ENV}MIN_INSYNC_REPLICAS)"
            )
        if short:
            lines.append(f"topic {t.topic} is under-replicated: {', '.join(short)}")
    return lines


def producer(kafka: KafkaConnection, **options: Any) -> AIOKafkaProducer:
    """An (unstarted) aiokafka producer on ``kafka``; ``options`` are the producer's own
    (``acks``, ``enable_idempotence``, ``linger_ms``...)."""
    return AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, **kafka.aiokafka_kwargs(), **options)


def consumer(kafka: KafkaConnection, *topics: str, **options: Any) -> AIOKafkaConsumer:
    """An (unstarted) aiokafka consumer on ``kafka``, subscribed to ``topics`` if any."""
    return AIOKafkaConsumer(
        *topics, bootstrap_servers=kafka.bootstrap, **kafka.aiokafka_kwargs(), **options
    )


def admin(kafka: KafkaConnection, **options: Any) -> AIOKafkaAdminClient:
    """An (unstarted) aiokafka admin client on ``kafka``."""
    return AIOKafkaAdminClient(
        bootstrap_servers=kafka.bootstrap, **kafka.aiokafka_kwargs(), **options
    )


def faust_app(kafka: KafkaConnection, app_id: str, **options: Any) -> faust.App:
    """A faust app on ``kafka``: its producers, consumers and topic creation get the
    credentials, and the topics it creates (changelogs, its leader topic) the replication
    factor. A table's ``min.insync.replicas`` is the table's ``extra_topic_configs``
    (:meth:`KafkaConnection.topic_configs`)."""
    import faust

    brokers = ";".join(f"kafka://{host.strip()}" for host in kafka.bootstrap.split(","))
    return faust.App(
        app_id,
        broker=brokers,
        broker_credentials=kafka.faust_credentials(),
        topic_replication_factor=kafka.replication_factor,
        **options,
    )


def explain(exc: BaseException, kafka: KafkaConnection) -> ConfigurationError | None:
    """The setting to fix when ``exc`` says the credentials or the certificates are wrong
    (one line naming the variable, never the password); None for any other failure."""
    import ssl

    from aiokafka.errors import SaslAuthenticationFailed, UnsupportedSaslMechanismError

    where = f"Kafka at {kafka.bootstrap}"
    if isinstance(exc, SaslAuthenticationFailed):
        return ConfigurationError(
            f"{where} refused user {kafka.sasl_username!r} ({kafka.sasl_mechanism}): check "
            f"{_ENV}SASL_USERNAME and {_ENV}SASL_PASSWORD or {_ENV}SASL_PASSWORD_FILE ({exc})"
        )
    if isinstance(exc, UnsupportedSaslMechanismError):
        return ConfigurationError(
            f"{where} does not accept {_ENV}SASL_MECHANISM={kafka.sasl_mechanism} ({exc})"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        reason = getattr(exc, "verify_message", None) or str(exc)
        trusted = kafka.ssl_cafile or "the system's CAs: none set"
        return ConfigurationError(
            f"{where}: its certificate is not trusted by {_ENV}SSL_CAFILE ({trusted}): {reason}"
        )
    if isinstance(exc, ssl.SSLError):
        return ConfigurationError(
            f"{where}: the TLS handshake failed; check {_ENV}SECURITY_PROTOCOL="
            f"{kafka.security_protocol} and {_ENV}SSL_* ({exc})"
        )
    return None


async def check(kafka: KafkaConnection, timeout_s: float = 10.0) -> bool:
    """Open one connection to a bootstrap broker at start (TLS and SASL included): wrong
    credentials or certificates stop the service with one line naming the setting; a
    broker merely unreachable does not (a service that runs without Kafka goes on): False.

    aiokafka's own clients log such a failure and raise only "Unable to bootstrap", so
    the connection is made here, where its error can be told apart.

    Raises:
        ConfigurationError: from :func:`explain`.
    """
    import asyncio

    from aiokafka.conn import create_conn

    options = kafka.aiokafka_kwargs()
    for server in kafka.bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            conn = await asyncio.wait_for(create_conn(host, int(port), **options), timeout_s)
        except Exception as exc:  # noqa: BLE001 - told apart below
            error = explain(exc, kafka)
            if error is not None:
                raise error from None
            continue
        conn.close()
        return True
    return False
