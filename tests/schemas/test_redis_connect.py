"""The one Redis connection setting: client arguments, the URL's old credentials, refusals
that name the variable, secrets never shown, and no client built without it."""

from __future__ import annotations

import ast
import logging
import os
import shutil
import ssl
import subprocess
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from spendgate.schemas import redis_connect
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.redis_connect import RedisConnection, RedisSettings, redact_url
from tests.fixtures import tls_redis
from tests.fixtures.admission import free_port
from tests.fixtures.services import _unavailable, say

ROOT = Path(__file__).resolve().parents[2]
#: The product's packages: every Redis client in them is built by ``schemas.redis_connect``.
PRODUCT = ("admission", "streams", "schemas", "spendgate", "dashboard")
FACTORY = ROOT / "schemas" / "redis_connect.py"
#: redis-py's clients and pools (asyncio and blocking), built directly or by a classmethod.
CLIENTS = {
    "Redis",
    "StrictRedis",
    "RedisCluster",
    "ConnectionPool",
    "BlockingConnectionPool",
    "Sentinel",
}
PASSWORD = "s3cr3t-pa55word"
#: A password the TLS redis-server refuses (the right one is ``tls_redis.PASSWORD``).
WRONG_PASSWORD = "wr0ng-s3cr3t-pa55word"
#: Every logger a connection goes through, each set to DEBUG (the root one included).
LOGGERS = ("", "redis", "asyncio", "aiokafka", "faust", "mode", "spendgate", "test")


@pytest.fixture(autouse=True)
def _no_redis_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the SPENDGATE_REDIS_* variables it reads; none leak in."""
    for name in list(os.environ):
        if name.startswith("SPENDGATE_REDIS_"):
            monkeypatch.delenv(name)


def _private(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def client_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and its (unencrypted) key."""
    if shutil.which("openssl") is None:
        _unavailable("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "client.pem", folder / "client.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=spendgate-test"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[tuple[tls_redis.Pki, int]]:
    """A real redis-server of this module's own (``tests.fixtures.tls_redis``): TLS only,
    client certificates required, the ``default`` user off; its PKI and TLS port."""
    started = time.monotonic()
    folder = tmp_path_factory.mktemp("tls-redis")
    pki = tls_redis.make_pki(folder)
    servers = tls_redis.Servers(folder)
    try:
        port = free_port()
        servers.start(tls_redis.server_args(pki, port), port, "redis")
        say(pytestconfig, f"TLS redis-server up in {time.monotonic() - started:.1f} s")
        yield pki, port
    finally:
        servers.stop()


def _shown(exc: BaseException) -> str:
    """Everything an error shows: ``str`` and ``repr`` of it and of each error it was
    raised from or while handling, and its whole traceback."""
    parts: list[str] = []
    seen: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in seen:
        seen.append(cause)
        parts += [str(cause), repr(cause), *traceback.format_exception(cause)]
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)


def _refusal(**env: str) -> str:
    with pytest.raises(ConfigurationError) as info:
        RedisSettings(**env).redis()  # type: ignore[arg-type]
    return str(info.value)


class TestClientArguments:
    def test_the_default_is_the_local_redis_without_credentials(self) -> None:
        conn = RedisSettings().redis()
        assert conn.url == "redis://127.0.0.1:6379/0"
        assert not conn.cluster and not conn.uses_tls
        assert conn.client_kwargs() == {}

    def test_tls_acl_and_a_password_file_from_the_environment(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client_cert: tuple[Path, Path]
    ) -> None:
        cert, key = client_cert
        monkeypatch.setenv("SPENDGATE_REDIS_URL", "rediss://redis.internal:6380/0")
        monkeypatch.setenv("SPENDGATE_REDIS_CLUSTER", "true")
        monkeypatch.setenv("SPENDGATE_REDIS_USERNAME", "spendgate")
        password_file = _private(tmp_path, "redis-password", PASSWORD + "\n")
        monkeypatch.setenv("SPENDGATE_REDIS_PASSWORD_FILE", str(password_file))
        monkeypatch.setenv("SPENDGATE_REDIS_SSL_CAFILE", str(cert))
        monkeypatch.setenv("SPENDGATE_REDIS_SSL_CERTFILE", str(cert))
        monkeypatch.setenv("SPENDGATE_REDIS_SSL_KEYFILE", str(key))
        monkeypatch.setenv("SPENDGATE_REDIS_SSL_CHECK_HOSTNAME", "false")
        conn = RedisSettings().redis()
        assert conn.cluster and conn.uses_tls
        assert conn.client_kwargs() == {
            "username": "spendgate",
            "password": PASSWORD,
            "ssl_check_hostname": False,
            "ssl_ca_certs": str(cert),
            "ssl_certfile": str(cert),
            "ssl_keyfile": str(key),
        }

    def test_every_service_reads_the_same_settings(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from spendgate.admission.settings import AdmissionSettings
        from spendgate.dashboard.settings import DashboardSettings
        from spendgate.streams.settings import WorkerSettings

        monkeypatch.setenv("SPENDGATE_REDIS_USERNAME", "spendgate")
        monkeypatch.setenv("SPENDGATE_REDIS_PASSWORD", PASSWORD)
        for settings in (AdmissionSettings(), WorkerSettings(), DashboardSettings()):
            assert settings.redis().client_kwargs() == {
                "username": "spendgate",
                "password": PASSWORD,
            }

    @pytest.mark.parametrize(
        ("url", "user", "shown"),
        [
            ("redis://spendgate:pw%40x@redis:6379/0", "spendgate", "redis://spendgate:***@redis:6379/0"),
            ("rediss://:pw%40x@10.0.0.5:6380/2", None, "rediss://:***@10.0.0.5:6380/2"),
        ],
    )  # fmt: skip
    def test_credentials_in_the_url_still_work_and_leave_it(
        self, url: str, user: str | None, shown: str
    ) -> None:
        conn = RedisSettings(redis_url=url).redis()
        assert "@" not in conn.url and "pw" not in conn.url
        assert conn.username == user
        assert conn.password is not None and conn.password.get_secret_value() == "pw@x"
        assert conn.redacted() == shown == redact_url(url)

    def test_the_factories_pass_everything(self, client_cert: tuple[Path, Path]) -> None:
        cert, key = client_cert
        conn = RedisConnection(
            url="rediss://127.0.0.1:1/3",
            username="u",
            password=PASSWORD,
            ssl_cafile=cert,
            ssl_certfile=cert,
            ssl_keyfile=key,
        )
        one = redis_connect.async_client(conn, pool_timeout_s=0.5, max_connections=4)
        pool = one.connection_pool
        assert type(pool).__name__ == "BlockingConnectionPool"
        assert (pool.max_connections, pool.timeout) == (4, 0.5)  # type: ignore[attr-defined]
        kwargs = pool.connection_kwargs
        assert pool.connection_class.__name__ == "SSLConnection"
        assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", PASSWORD, 3)
        assert kwargs["ssl_ca_certs"] == str(cert) and kwargs["ssl_keyfile"] == str(key)
        on_cluster = RedisConnection(
            **{**dict(conn), "url": "rediss://127.0.0.1:1/0", "cluster": True}
        )
        cluster = redis_connect.async_client(on_cluster)
        assert isinstance(cluster, RedisCluster)
        node_kwargs = cluster.connection_kwargs
        assert node_kwargs["connection_class"].__name__ == "SSLConnection"
        assert (node_kwargs["username"], node_kwargs["password"]) == ("u", PASSWORD)
        assert node_kwargs["ssl_ca_certs"] == str(cert)
        sync = redis_connect.client(conn, socket_timeout=1.0)
        assert isinstance(sync, redis.Redis)
        sync_kwargs = sync.connection_pool.connection_kwargs
        assert (sync_kwargs["password"], sync_kwargs["ssl_certfile"]) == (PASSWORD, str(cert))
        sync.close()


class TestRefusals:
    def test_tls_files_with_a_plain_url(self, client_cert: tuple[Path, Path]) -> None:
        message = _refusal(redis_ssl_cafile=str(client_cert[0]))
        assert message == (
            "SPENDGATE_REDIS_SSL_CAFILE is set but SPENDGATE_REDIS_URL=redis://127.0.0.1:6379/0 "
            "does not use TLS (use rediss://)"
        )

    def test_a_missing_tls_file(self, tmp_path: Path) -> None:
        missing = tmp_path / "nope.pem"
        message = _refusal(redis_url="rediss://r:6380/0", redis_ssl_cafile=str(missing))
        assert message == f"SPENDGATE_REDIS_SSL_CAFILE={missing}: no such readable file"

    def test_a_certificate_without_its_key(self, client_cert: tuple[Path, Path]) -> None:
        message = _refusal(redis_url="rediss://r:6380/0", redis_ssl_certfile=str(client_cert[0]))
        assert "SPENDGATE_REDIS_SSL_CERTFILE and SPENDGATE_REDIS_SSL_KEYFILE" in message

    def test_a_password_and_its_file(self, tmp_path: Path) -> None:
        message = _refusal(
            redis_password=PASSWORD, redis_password_file=str(_private(tmp_path, "p", PASSWORD))
        )
        assert message == "set SPENDGATE_REDIS_PASSWORD or SPENDGATE_REDIS_PASSWORD_FILE, not both"

    def test_a_password_in_the_url_and_in_its_setting(self) -> None:
        message = _refusal(redis_url="redis://:old@r:6379/0", redis_password=PASSWORD)
        assert "SPENDGATE_REDIS_URL and in SPENDGATE_REDIS_PASSWORD" in message
        assert PASSWORD not in message and "old" not in message

    def test_two_users(self) -> None:
        message = _refusal(redis_url="redis://a:pw@r:6379/0", redis_username="b")
        assert "SPENDGATE_REDIS_USERNAME" in message and "pw" not in message

    @pytest.mark.parametrize("mode", [0o644, 0o666, 0o604, 0o660], ids=oct)
    def test_a_password_file_others_can_read(self, tmp_path: Path, mode: int) -> None:
        path = _private(tmp_path, "p", PASSWORD)
        path.chmod(mode)
        message = _refusal(redis_password_file=str(path))
        assert "chmod 600" in message and PASSWORD not in message

    @pytest.mark.parametrize("mode", [0o640, 0o440, 0o400], ids=oct)
    def test_a_password_file_its_group_can_read(self, tmp_path: Path, mode: int) -> None:
        # As a Kubernetes Secret volume mounts it (defaultMode 0440 with an fsGroup).
        path = _private(tmp_path, "p", PASSWORD + "\n")
        path.chmod(mode)
        conn = RedisSettings(redis_password_file=path).redis()  # type: ignore[call-arg]
        assert conn.client_kwargs() == {"password": PASSWORD}

    def test_a_cluster_has_only_database_0(self) -> None:
        message = _refusal(redis_url="redis://r:7000/2", redis_cluster="true")
        assert "SPENDGATE_REDIS_CLUSTER=true but SPENDGATE_REDIS_URL=redis://r:7000/2" in message

    def test_not_a_redis_url(self) -> None:
        message = _refusal(redis_url="http://r:6379/0")
        assert message.startswith("SPENDGATE_REDIS_URL=http://r:6379/0 is not a Redis URL")

    def test_a_bad_switch_is_a_settings_error(self) -> None:
        with pytest.raises(ValueError, match="redis_ssl_check_hostname"):
            RedisSettings(redis_ssl_check_hostname="maybe")


class TestExplain:
    CONN = RedisConnection(
        url="rediss://r:6380/0",
        username="spendgate",
        password=PASSWORD,
        ssl_cafile=Path("/etc/ca.pem"),
    )

    def test_refused_credentials_name_the_password_variables(self) -> None:
        error = redis_connect.explain(AuthenticationError("invalid username-password"), self.CONN)
        assert error is not None
        assert str(error).startswith("Redis at rediss://spendgate:***@r:6380/0 refused user")
        assert "SPENDGATE_REDIS_PASSWORD or SPENDGATE_REDIS_PASSWORD_FILE" in str(error)

    def test_an_untrusted_certificate_names_the_ca_variable(self) -> None:
        # redis-py raises its ConnectionError while handling the socket's TLS error.
        wrapped = RedisConnectionError("Error 1 connecting to r:6380. certificate verify failed")
        wrapped.__context__ = ssl.SSLCertVerificationError(1, "certificate verify failed")
        error = redis_connect.explain(wrapped, self.CONN)
        assert error is not None
        assert "not trusted by SPENDGATE_REDIS_SSL_CAFILE (/etc/ca.pem)" in str(error)

    def test_an_unreachable_redis_is_not_a_setting(self) -> None:
        refused = RedisConnectionError("Error 111 connecting to r:6380. Connection refused.")
        assert redis_connect.explain(refused, self.CONN) is None


class TestSecrets:
    def test_never_in_repr_or_str(self) -> None:
        settings = RedisSettings(
            redis_url=f"redis://spendgate:{PASSWORD}@r:6379/0",
            redis_username="spendgate",
        )
        conn = settings.redis()
        for shown in (repr(settings), str(settings), repr(conn), str(conn), conn.redacted()):
            assert PASSWORD not in shown
        assert "**********" in repr(conn)
        assert str(conn) == "redis://spendgate:***@r:6379/0"
        env = RedisSettings(redis_password=PASSWORD)
        assert PASSWORD not in repr(env) and PASSWORD not in repr(env.redis())

    @pytest.mark.integration
    async def test_never_logged(
        self, tls_server: tuple[tls_redis.Pki, int], caplog: pytest.LogCaptureFixture
    ) -> None:
        """At DEBUG on every logger, a real TLS redis-server with an ACL user is given its
        password (let in) and a wrong one (refused at AUTH), by the asyncio and the
        blocking client: neither is in a log line or in an error's text."""
        for name in LOGGERS:
            caplog.set_level(logging.DEBUG, logger=name)
        pki, port = tls_server
        right = RedisSettings(**tls_redis.redis_settings(pki, port)).redis()
        # The wrong one the old way, inside the URL (taken out of it into the field).
        url = f"rediss://{tls_redis.USER}:{WRONG_PASSWORD}@127.0.0.1:{port}/0"
        settings = tls_redis.redis_settings(pki, port, redis_url=url, redis_password_file=None)
        wrong = RedisSettings(**settings).redis()
        logging.getLogger("test").info("connecting to %s (%r) and %s (%r)", right, right,
                                       wrong, wrong)  # fmt: skip
        errors: list[BaseException] = []

        # The right password: the start check, a write and a read are let in.
        client = redis_connect.async_client(right, socket_timeout=10)
        try:
            assert await redis_connect.check(client, right) is True
            key = f"sg-secret-test:{os.getpid()}"
            await client.set(key, b"1", ex=60)
            assert await client.get(key) == b"1"
        finally:
            await client.aclose()
        blocking = redis_connect.client(right, socket_timeout=10)
        try:
            assert blocking.ping() is True
        finally:
            blocking.close()

        # A wrong one: refused at AUTH, by each client.
        client = redis_connect.async_client(wrong, socket_timeout=10)
        try:
            with pytest.raises(ConfigurationError) as refused:
                await redis_connect.check(client, wrong)
            with pytest.raises(AuthenticationError) as failed:
                await client.ping()
        finally:
            await client.aclose()
        assert f"refused user {tls_redis.USER!r} with a password" in str(refused.value)
        errors += [refused.value, failed.value]
        blocking = redis_connect.client(wrong, socket_timeout=10)
        try:
            with pytest.raises(AuthenticationError) as failed:
                blocking.ping()
        finally:
            blocking.close()
        errors.append(failed.value)

        # At DEBUG: redis-py's connections log there (after AUTH, in this version).
        assert all(logging.getLogger(name).isEnabledFor(logging.DEBUG) for name in
                   ("redis.connection", "redis.asyncio.connection"))  # fmt: skip
        assert caplog.records
        secrets = {"right": tls_redis.PASSWORD, "wrong": WRONG_PASSWORD}
        leaks = [f"the {which} password is in the log" for which, secret in secrets.items()
                 if secret in caplog.text]  # fmt: skip
        leaks += [f"the {which} password is in {type(exc).__name__}: {exc}"
                  for which, secret in secrets.items()
                  for exc in errors if secret in _shown(exc)]  # fmt: skip
        assert not leaks, leaks


_MODULES = ("redis", "redis.asyncio", "redis.cluster", "redis.asyncio.cluster", "redis.client")


def _client_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """The calls in ``tree`` that build a redis-py client or pool directly, or through a
    ``from_url``/``from_pool`` (imported names followed through ``as``)."""
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "redis":
                    imported[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "redis":
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = ast.unparse(node.func)
        head, _, rest = dotted.partition(".")
        name = f"{imported[head]}.{rest}".rstrip(".") if head in imported else dotted
        parts = name.split(".")
        if parts[-1] in ("from_url", "from_pool"):
            owner = ".".join(parts[:-1])
            if parts[-2] in CLIENTS or owner in _MODULES:
                found.append((node.lineno, name))
        elif parts[-1] in CLIENTS and (name.startswith("redis") or len(parts) == 1):
            found.append((node.lineno, name))
    return found


class TestOneWayToBuildAClient:
    def test_no_client_is_built_outside_the_factories(self) -> None:
        offenders = []
        files = [p for package in PRODUCT for p in sorted((ROOT / package).rglob("*.py"))]
        assert len(files) > 100
        for path in files:
            if path == FACTORY:
                continue
            for line, call in _client_calls(ast.parse(path.read_text(), str(path))):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {call}(...)")
        assert offenders == [], (
            "build Redis clients with spendgate.schemas.redis_connect (async_client, client), "
            "which pass the connection settings:\n" + "\n".join(offenders)
        )

    @pytest.mark.parametrize(
        "source",
        [
            "import redis\nredis.Redis(port=1)",
            "import redis\nredis.Redis.from_url('redis://x')",
            "import redis\nredis.from_url('redis://x')",
            "import redis.asyncio as aioredis\naioredis.Redis.from_url('redis://x')",
            "import redis.asyncio as aioredis\naioredis.from_url('redis://x')",
            "from redis import asyncio as r\nr.Redis.from_pool(p)",
            "from redis.asyncio import BlockingConnectionPool as P\nP.from_url('u')",
            "from redis.asyncio.cluster import RedisCluster\nRedisCluster.from_url('u')",
            "from redis.cluster import RedisCluster as C\nC(host='h')",
            "from redis.asyncio import ConnectionPool\nConnectionPool(max_connections=1)",
            "from redis import StrictRedis\nStrictRedis()",
        ],
    )
    def test_the_scan_sees_each_way(self, source: str) -> None:
        assert len(_client_calls(ast.parse(source))) == 1

    def test_the_scan_leaves_other_calls(self) -> None:
        source = (
            "import redis\nredis.exceptions.ConnectionError('x')\nfrom x import y\ny.from_url('u')"
        )
        assert _client_calls(ast.parse(source)) == []

    def test_the_factory_module_builds_each_kind(self) -> None:
        calls = {call for _, call in _client_calls(ast.parse(FACTORY.read_text()))}
        assert calls == {
            "redis.asyncio.cluster.RedisCluster.from_url",
            "redis.asyncio.BlockingConnectionPool.from_url",
            "redis.asyncio.Redis.from_pool",
            "redis.asyncio.Redis.from_url",
            "redis.cluster.RedisCluster.from_url",
            "redis.Redis.from_url",
        }
