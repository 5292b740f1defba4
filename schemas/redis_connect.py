"""The one Redis connection setting (TLS, ACL user) and the only place Redis clients are
built: one Redis, or a Redis Cluster (redis-py's cluster client, which routes every command
by its key's slot and follows failovers), asyncio or blocking.

Settings (environment prefix ``SPENDGATE_REDIS_``, read by :class:`RedisSettings`, which
every service's settings class includes)::

    URL                 redis://host:port/db, or rediss:// for TLS (any node of a cluster)
    CLUSTER             the URL names a node of a Redis Cluster
    USERNAME            the ACL user (none: ``default``)
    PASSWORD            or PASSWORD_FILE (mode 600/640/400/440)
    SSL_CAFILE          CA bundle (PEM) trusted for the server's certificate (rediss://)
    SSL_CERTFILE        client certificate (PEM), when the server asks (tls-auth-clients)
    SSL_KEYFILE         its private key (PEM, unencrypted)
    SSL_CHECK_HOSTNAME  the certificate must name the URL's host (default true)

A user or password inside the URL still works (they are taken out of it into the fields
above, so :attr:`RedisConnection.url` never holds a password); one given both ways is
refused. The password is a :class:`~pydantic.SecretStr`: its ``repr`` and ``str`` show
``**********``; only the client factories read the value. Print a connection with
:meth:`RedisConnection.redacted`.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Self
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.cluster import RedisCluster
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    RedisClusterException,
    ResponseError,
)

from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.key_settings import readable_files, secret_or_file, settings_error
from spendgate.schemas.layout import Layout
from spendgate.schemas.types import Switch

__all__ = [
    "RedisConnection",
    "RedisSettings",
    "async_client",
    "check",
    "client",
    "explain",
    "layout_of",
    "redact_url",
]

_ENV = "SPENDGATE_REDIS_"
_PASSWORD = f"{_ENV}PASSWORD or {_ENV}PASSWORD_FILE"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, fit to print or log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***" if parts.username else ":***"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


class RedisConnection(BaseModel):
    """How every client reaches Redis (one server or a cluster).

    Built by :meth:`RedisSettings.redis` from the environment (or directly in tests); a
    combination that cannot connect is refused with a message naming the variable.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Without user or password (they move to the fields below when given in it).
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    username: str | None = None
    password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_check_hostname: bool = True

    @property
    def uses_tls(self) -> bool:
        """Whether the URL asks for TLS (``rediss://``)."""
        return urlsplit(self.url).scheme == "rediss"

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_the_url(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        parts = urlsplit(data["url"])
        if parts.username is None and parts.password is None:
            return data
        data = dict(data)
        if parts.username:
            given = data.get("username")
            if given is not None and given != unquote(parts.username):
                raise ValueError(
                    f"{_ENV}URL names user {unquote(parts.username)!r} and {_ENV}USERNAME "
                    f"{given!r}: keep one ({_ENV}USERNAME)"
                )
            data["username"] = unquote(parts.username)
        if parts.password is not None:
            if data.get("password") is not None:
                raise ValueError(
                    f"a password is in {_ENV}URL and in {_PASSWORD}: keep one ({_ENV}PASSWORD_FILE)"
                )
            data["password"] = SecretStr(unquote(parts.password))
        host = parts.netloc.rpartition("@")[2]
        data["url"] = urlunsplit(parts._replace(netloc=host))
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"{_ENV}URL={self.url} is not a Redis URL (redis://, rediss:// or unix://)"
            )
        if not self.uses_tls:
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{_ENV}{name.upper()} is set but {_ENV}URL={self.url} does not use "
                        "TLS (use rediss://)"
                    )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(f"set both {_ENV}SSL_CERTFILE and {_ENV}SSL_KEYFILE, or neither")
        if self.cluster and scheme == "unix":
            raise ValueError(f"{_ENV}CLUSTER=true needs a redis:// or rediss:// {_ENV}URL")
        if self.cluster and urlsplit(self.url).path.strip("/") not in ("", "0"):
            raise ValueError(
                f"{_ENV}CLUSTER=true but {_ENV}URL={self.url} names a database other than 0 "
                "(a cluster has only database 0)"
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

    def redacted(self) -> str:
        """The URL to print or log: the user shown, a password as ``***``."""
        if self.username is None and self.password is None:
            return self.url
        parts = urlsplit(self.url)
        user = self.username or ""
        secret = ":***" if self.password is not None else ""
        return urlunsplit(parts._replace(netloc=f"{user}{secret}@{parts.netloc}"))

    def __str__(self) -> str:
        return self.redacted()

    def client_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of redis-py's ``from_url`` (the URL excepted), the same for
        ``Redis``, ``RedisCluster`` and the connection pools, asyncio or blocking."""
        kwargs: dict[str, Any] = {}
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password.get_secret_value()
        if self.uses_tls:
            kwargs["ssl_check_hostname"] = self.ssl_check_hostname
            if self.ssl_cafile is not None:
                kwargs["ssl_ca_certs"] = str(self.ssl_cafile)
            if self.ssl_certfile is not None and self.ssl_keyfile is not None:
                kwargs["ssl_certfile"] = str(self.ssl_certfile)
                kwargs["ssl_keyfile"] = str(self.ssl_keyfile)
        return kwargs


class RedisSettings(BaseSettings):
    """The ``SPENDGATE_REDIS_*`` connection settings, shared by every service's settings."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    # Kept out of ``repr``: an old-style URL may still carry a password.
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        repr=False,
        description="`redis://host:port/db`, or `rediss://` for TLS; on a cluster any node "
        "(db 0). Keep the password in `SPENDGATE_REDIS_PASSWORD(_FILE)`, not here.",
    )
    redis_cluster: Switch = Field(
        False,
        description="`SPENDGATE_REDIS_URL` names a node of a Redis Cluster: keys are laid out "
        "by virtual shard and the cluster client is used; the same in every service.",
    )
    redis_username: str | None = Field(None, description="The ACL user (none: Redis's `default`).")
    redis_password: SecretStr | None = Field(
        None,
        description="The Redis password (or `SPENDGATE_REDIS_PASSWORD_FILE`); never logged.",
    )
    redis_password_file: Path | None = Field(
        None,
        description="A file holding the Redis password (mode 600, 640, 400 or 440: others may "
        "not read it; surrounding whitespace ignored).",
    )
    redis_ssl_cafile: Path | None = Field(
        None,
        description="PEM bundle trusted for the server's certificate (`rediss://` only; "
        "none: the system's CAs).",
    )
    redis_ssl_certfile: Path | None = Field(
        None,
        description="Client certificate (PEM), when the server asks for one "
        "(`tls-auth-clients yes`).",
    )
    redis_ssl_keyfile: Path | None = Field(
        None, description="The client certificate's unencrypted key (PEM)."
    )
    redis_ssl_check_hostname: Switch = Field(
        True, description="The server's certificate must name the URL's host."
    )

    def redis(self) -> RedisConnection:
        """The connection these settings describe (the password file is read on each call).

        Raises:
            ConfigurationError: a bad combination, both a password and its file, an
                unreadable or shared password file, or a missing TLS file.
        """
        password = secret_or_file(self.redis_password, self.redis_password_file, f"{_ENV}PASSWORD")
        try:
            connection = RedisConnection(
                url=self.redis_url,
                cluster=self.redis_cluster,
                username=self.redis_username,
                password=password,
                ssl_cafile=self.redis_ssl_cafile,
                ssl_certfile=self.redis_ssl_certfile,
                ssl_keyfile=self.redis_ssl_keyfile,
                ssl_check_hostname=self.redis_ssl_check_hostname,
            )
        except ValidationError as exc:
            raise settings_error(exc) from None
        return connection.check_files()


def async_client(
    conn: RedisConnection, *, pool_timeout_s: float | None = None, **options: Any
) -> aioredis.Redis:
    """An asyncio client on ``conn``: any node of the cluster when ``conn.cluster`` (typed
    as a plain client: the commands spendgate sends exist on both).

    Args:
        conn: where and how.
        pool_timeout_s: on one Redis, a ``BlockingConnectionPool`` (owned by the client)
            whose callers wait this long for a connection when ``max_connections`` are in
            use; a cluster keeps its pool per node.
        options: the client's own (``max_connections``, ``socket_timeout``, ``retry``...).
    """
    kwargs = {**conn.client_kwargs(), **options}
    if conn.cluster:
        return RedisCluster.from_url(conn.url, **kwargs)  # type: ignore[return-value]
    if pool_timeout_s is not None:
        pool = BlockingConnectionPool.from_url(conn.url, timeout=pool_timeout_s, **kwargs)
        # Owned by the client: closing it disconnects the pool (else the sockets leak).
        return aioredis.Redis.from_pool(pool)
    return aioredis.Redis.from_url(conn.url, **kwargs)


def client(conn: RedisConnection, **options: Any) -> redis.Redis:
    """A blocking client on ``conn`` (the CLI's), a cluster client when ``conn.cluster``."""
    kwargs = {**conn.client_kwargs(), **options}
    if conn.cluster:
        return SyncRedisCluster.from_url(conn.url, **kwargs)  # type: ignore[return-value]
    return redis.Redis.from_url(conn.url, **kwargs)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from or while handling (redis-py wraps socket and TLS
    errors in its own, a cluster client its nodes' errors in one more)."""
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in seen:
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    return seen


def _refused_credentials(exc: BaseException) -> bool:
    if isinstance(exc, AuthenticationError | AuthenticationWrongNumberOfArgsError):
        return True
    text = str(exc)
    return isinstance(exc, ResponseError) and text.startswith(("WRONGPASS", "NOAUTH"))


def explain(exc: BaseException, conn: RedisConnection) -> ConfigurationError | None:
    """The setting to fix when ``exc`` says the credentials or the certificates are wrong
    (one line naming the variable, never the password); None for any other failure."""
    where = f"Redis at {conn.redacted()}"
    chain = _chain(exc)
    refused = next((e for e in chain if _refused_credentials(e)), None)
    if refused is not None:
        user = conn.username or "default"
        given = "a password" if conn.password is not None else "no password"
        return ConfigurationError(
            f"{where} refused user {user!r} with {given}: check {_ENV}USERNAME and "
            f"{_PASSWORD} ({refused})"
        )
    tls = next((e for e in chain if isinstance(e, ssl.SSLError)), None)
    if isinstance(tls, ssl.SSLCertVerificationError):
        reason = getattr(tls, "verify_message", None) or str(tls)
        if "match" in reason or "mismatch" in reason:
            return ConfigurationError(
                f"{where}: its certificate does not name the host ({reason}); connect by "
                f"a name it holds, or set {_ENV}SSL_CHECK_HOSTNAME=false"
            )
        trusted = conn.ssl_cafile or "the system's CAs: none set"
        return ConfigurationError(
            f"{where}: its certificate is not trusted by {_ENV}SSL_CAFILE ({trusted}): {reason}"
        )
    if (
        tls is None
        and conn.uses_tls
        and conn.ssl_certfile is None
        and any(isinstance(e, ConnectionResetError) for e in chain)
    ):
        # TLS 1.3: the handshake ends before the server checks for a client certificate,
        # so a server that requires one (tls-auth-clients yes) just resets the connection.
        return ConfigurationError(
            f"{where} reset the connection after the TLS handshake: it may require a client "
            f"certificate (tls-auth-clients yes); set {_ENV}SSL_CERTFILE and {_ENV}SSL_KEYFILE"
        )
    if tls is not None:
        return ConfigurationError(
            f"{where}: the TLS handshake failed ({tls.reason or tls}); check {_ENV}SSL_CAFILE, "
            f"{_ENV}SSL_CERTFILE and {_ENV}SSL_KEYFILE (the server may ask for a client "
            "certificate)"
        )
    return None


async def check(client: aioredis.Redis, conn: RedisConnection) -> bool:
    """PING ``client`` once at start: wrong credentials or certificates stop the service
    with one line naming the setting; a Redis merely unreachable does not (the failure
    modes answer for it): False.

    Raises:
        ConfigurationError: from :func:`explain`.
    """
    try:
        await client.ping()
    except (redis.RedisError, RedisClusterException, OSError) as exc:
        error = explain(exc, conn)
        if error is not None:
            raise error from None
        return False
    return True


def layout_of(prefix: str, cluster: bool) -> Layout:
    """The key layout of a deployment (``schemas.layout``)."""
    return Layout(prefix, cluster=cluster)
