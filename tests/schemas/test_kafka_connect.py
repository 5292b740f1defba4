"""The one Kafka connection setting: each protocol's client arguments, faust's credentials,
refusals that name the variable, secrets never shown, and no client built without it."""

from __future__ import annotations

import ast
import logging
import shutil
import socket
import ssl
import subprocess
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError
from faust.auth import SASLCredentials, SSLCredentials
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from pydantic import SecretStr

from spendgate.devkafka import SCRAM_USER, KafkaClusterSettings, LocalKafkaCluster
from spendgate.schemas import kafka_connect
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.kafka_connect import (
    KafkaConnection,
    KafkaSettings,
    TopicReplication,
    shortfalls,
)
from tests.fixtures.services import _unavailable, say

ROOT = Path(__file__).resolve().parents[2]
#: The product's packages: every Kafka client in them is built by ``schemas.kafka_connect``.
PRODUCT = ("admission", "streams", "schemas", "spendgate", "dashboard")
FACTORY = ROOT / "schemas" / "kafka_connect.py"
CLIENTS = {"AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient", "AIOKafkaClient"}
PASSWORD = "s3cr3t-pa55word"
#: The real broker of ``TestSecrets.test_never_logged``: clients on 31800, its controller
#: on 31900, replication on 32000; below the ephemeral range (32768) and apart from the
#: other clusters' ports (29400-29902, 30400-30502, 30600-30800, and 31400-31702: a
#: 3-broker SASL_SSL cluster on 31400 replicates on 31600-31602).
OWN_PORTS = 31800
#: A password the broker refuses (the right one is the broker's own, random).
WRONG_PASSWORD = "wr0ng-s3cr3t-pa55word"
#: Every logger a connection goes through, each set to DEBUG (the root one included).
LOGGERS = ("", "aiokafka", "faust", "mode", "redis", "asyncio", "spendgate", "test")


@pytest.fixture(autouse=True)
def _no_kafka_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the SPENDGATE_KAFKA_* variables it reads; none leak in."""
    import os

    for name in list(os.environ):
        if name.startswith("SPENDGATE_KAFKA_"):
            monkeypatch.delenv(name)


def _private(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def client_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and its key, encrypted with ``"keypass"``."""
    if shutil.which("openssl") is None:
        _unavailable("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "client.pem", folder / "client.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", str(key), "-out",
         str(cert), "-days", "1", "-subj", "/CN=spendgate-test", "-passout", "pass:keypass"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def sasl_broker(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[LocalKafkaCluster]:
    """One real broker of this module's own: SASL_SSL with SCRAM-SHA-512
    (``spendgate.devkafka``), stopped at the end."""
    if shutil.which("java") is None or shutil.which("openssl") is None:
        _unavailable("java and openssl are needed for the SASL_SSL broker")
    settings = KafkaClusterSettings(
        kafka_cluster_port=OWN_PORTS, stack_dir=tmp_path_factory.mktemp("kafka")
    )
    kafka = LocalKafkaCluster(settings, 1, "sasl_ssl")
    started = time.monotonic()
    try:
        kafka.up()
        say(pytestconfig, f"SASL_SSL broker up in {time.monotonic() - started:.1f} s")
        yield kafka
    finally:
        kafka.down()


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
        KafkaSettings(**env).kafka()  # type: ignore[arg-type]
    return str(info.value)


class TestClientArguments:
    def test_plaintext_is_the_default(self) -> None:
        kafka = KafkaSettings().kafka()
        assert kafka.aiokafka_kwargs() == {"security_protocol": "PLAINTEXT"}
        assert kafka.faust_credentials() is None
        assert (kafka.replication_factor, kafka.min_insync_replicas) == (1, 1)

    @pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
    def test_sasl_plaintext(self, mechanism: str) -> None:
        kafka = KafkaConnection(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism=mechanism,  # type: ignore[arg-type]
            sasl_username="spendgate",
            sasl_password=PASSWORD,  # type: ignore[arg-type]
        )
        assert kafka.aiokafka_kwargs() == {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": mechanism,
            "sasl_plain_username": "spendgate",
            "sasl_plain_password": PASSWORD,
        }

    def test_sasl_ssl_from_the_environment(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        import certifi

        monkeypatch.setenv("SPENDGATE_KAFKA_BOOTSTRAP", "b1:9093,b2:9093")
        monkeypatch.setenv("SPENDGATE_KAFKA_SECURITY_PROTOCOL", "sasl_ssl")
        monkeypatch.setenv("SPENDGATE_KAFKA_SASL_MECHANISM", "scram-sha-512")
        monkeypatch.setenv("SPENDGATE_KAFKA_SASL_USERNAME", "spendgate")
        password_file = _private(tmp_path, "kafka-password", PASSWORD + "\n")
        monkeypatch.setenv("SPENDGATE_KAFKA_SASL_PASSWORD_FILE", str(password_file))
        monkeypatch.setenv("SPENDGATE_KAFKA_SSL_CAFILE", certifi.where())
        kafka = KafkaSettings().kafka()
        kwargs = kafka.aiokafka_kwargs()
        assert isinstance(kwargs.pop("ssl_context"), ssl.SSLContext)
        assert kwargs == {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": "spendgate",
            "sasl_plain_password": PASSWORD,
        }
        # faust-streaming maps its credentials to the same aiokafka arguments.
        credentials = kafka.faust_credentials()
        assert isinstance(credentials, SASLCredentials)
        mapped = dict(credentials_to_aiokafka_auth(credentials))
        assert isinstance(mapped.pop("ssl_context"), ssl.SSLContext)
        assert mapped == kwargs

    def test_ssl_with_a_client_certificate(self, client_cert: tuple[Path, Path]) -> None:
        cert, key = client_cert
        kafka = KafkaConnection(
            security_protocol="SSL",
            ssl_certfile=cert,
            ssl_keyfile=key,
            ssl_key_password="keypass",  # type: ignore[arg-type]
        ).check_files()
        kwargs = kafka.aiokafka_kwargs()
        assert kwargs["security_protocol"] == "SSL"
        assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
        credentials = kafka.faust_credentials()
        assert isinstance(credentials, SSLCredentials)
        assert credentials_to_aiokafka_auth(credentials)["security_protocol"] == "SSL"

    def test_a_wrong_key_password_fails_when_the_context_is_built(
        self, client_cert: tuple[Path, Path]
    ) -> None:
        cert, key = client_cert
        kafka = KafkaConnection(
            security_protocol="SSL",
            ssl_certfile=cert,
            ssl_keyfile=key,
            ssl_key_password="wrong",  # type: ignore[arg-type]
        )
        with pytest.raises(ssl.SSLError):
            kafka.ssl_context()

    async def test_the_factories_pass_everything(self) -> None:
        kafka = KafkaConnection(
            bootstrap="127.0.0.1:1",
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-256",
            sasl_username="u",
            sasl_password=PASSWORD,  # type: ignore[arg-type]
        )
        producer = kafka_connect.producer(kafka, acks="all", enable_idempotence=True)
        assert producer.client._sasl_mechanism == "SCRAM-SHA-256"
        assert producer.client._security_protocol == "SASL_PLAINTEXT"
        assert producer.client._bootstrap_servers == "127.0.0.1:1"
        consumer = kafka_connect.consumer(kafka, "t", enable_auto_commit=False)
        assert consumer._client._sasl_plain_password == PASSWORD
        await consumer.stop()  # never started: only marks it closed
        admin = kafka_connect.admin(kafka)
        assert admin._client._sasl_plain_username == "u"
        await producer.stop()

    def test_the_faust_app_gets_credentials_and_replication(self) -> None:
        kafka = KafkaConnection(
            bootstrap="b1:9093,b2:9094",
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username="u",
            sasl_password=PASSWORD,  # type: ignore[arg-type]
            replication_factor=3,
            min_insync_replicas=2,
        )
        app = kafka_connect.faust_app(kafka, "sg-test")
        assert [str(u) for u in app.conf.broker] == ["kafka://b1:9093", "kafka://b2:9094"]
        assert isinstance(app.conf.broker_credentials, SASLCredentials)
        assert app.conf.broker_credentials.mechanism.value == "SCRAM-SHA-512"
        assert app.conf.topic_replication_factor == 3
        assert kafka.topic_configs() == {"min.insync.replicas": "2"}


class TestRefusals:
    def test_sasl_without_a_mechanism(self) -> None:
        message = _refusal(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_username="u",
            kafka_sasl_password=PASSWORD,
        )
        assert "SPENDGATE_KAFKA_SASL_MECHANISM" in message

    def test_sasl_without_a_username(self) -> None:
        message = _refusal(
            kafka_security_protocol="SASL_PLAINTEXT",
            kafka_sasl_mechanism="PLAIN",
            kafka_sasl_password=PASSWORD,
        )
        assert "SPENDGATE_KAFKA_SASL_USERNAME" in message

    def test_sasl_without_a_password_names_both_variables(self) -> None:
        message = _refusal(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="SCRAM-SHA-512",
            kafka_sasl_username="u",
        )
        assert "SPENDGATE_KAFKA_SASL_PASSWORD or SPENDGATE_KAFKA_SASL_PASSWORD_FILE" in message

    def test_a_password_and_its_file(self, tmp_path: Path) -> None:
        message = _refusal(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="PLAIN",
            kafka_sasl_username="u",
            kafka_sasl_password=PASSWORD,
            kafka_sasl_password_file=str(_private(tmp_path, "p", PASSWORD)),
        )
        assert "SPENDGATE_KAFKA_SASL_PASSWORD or SPENDGATE_KAFKA_SASL_PASSWORD_FILE" in message
        assert PASSWORD not in message

    @pytest.mark.parametrize("mode", [0o644, 0o666, 0o604, 0o660], ids=oct)
    def test_a_password_file_others_can_read(self, tmp_path: Path, mode: int) -> None:
        path = _private(tmp_path, "p", PASSWORD)
        path.chmod(mode)
        message = _refusal(
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="PLAIN",
            kafka_sasl_username="u",
            kafka_sasl_password_file=str(path),
        )
        assert "chmod 600" in message and PASSWORD not in message

    @pytest.mark.parametrize("mode", [0o640, 0o440, 0o400], ids=oct)
    def test_a_password_file_its_group_can_read(self, tmp_path: Path, mode: int) -> None:
        # As a Kubernetes Secret volume mounts it (defaultMode 0440 with an fsGroup).
        path = _private(tmp_path, "p", PASSWORD + "\n")
        path.chmod(mode)
        kafka = KafkaSettings(  # type: ignore[call-arg]
            kafka_security_protocol="SASL_PLAINTEXT",
            kafka_sasl_mechanism="PLAIN",
            kafka_sasl_username="u",
            kafka_sasl_password_file=path,
        ).kafka()
        assert kafka.aiokafka_kwargs()["sasl_plain_password"] == PASSWORD

    def test_sasl_settings_on_a_protocol_without_sasl(self) -> None:
        message = _refusal(kafka_security_protocol="SSL", kafka_sasl_username="u")
        assert "SPENDGATE_KAFKA_SASL_USERNAME is set" in message
        assert "SASL_PLAINTEXT or SASL_SSL" in message

    def test_tls_files_on_a_protocol_without_tls(self, tmp_path: Path) -> None:
        ca = _private(tmp_path, "ca.pem", "")
        message = _refusal(kafka_ssl_cafile=str(ca))
        assert "SPENDGATE_KAFKA_SSL_CAFILE is set" in message and "SSL or SASL_SSL" in message

    def test_a_missing_tls_file(self, tmp_path: Path) -> None:
        missing = tmp_path / "nope.pem"
        message = _refusal(kafka_security_protocol="SSL", kafka_ssl_cafile=str(missing))
        assert message == f"SPENDGATE_KAFKA_SSL_CAFILE={missing}: no such readable file"

    def test_a_certificate_without_its_key(self, client_cert: tuple[Path, Path]) -> None:
        message = _refusal(kafka_security_protocol="SSL", kafka_ssl_certfile=str(client_cert[0]))
        assert "SPENDGATE_KAFKA_SSL_CERTFILE and SPENDGATE_KAFKA_SSL_KEYFILE" in message

    def test_more_insync_replicas_than_replicas(self) -> None:
        message = _refusal(kafka_replication_factor="1", kafka_min_insync_replicas="2")
        assert "SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS (2) exceeds" in message

    def test_an_unknown_protocol_is_a_settings_error(self) -> None:
        with pytest.raises(ValueError, match="kafka_security_protocol"):
            KafkaSettings(kafka_security_protocol="SASL-SSL")  # type: ignore[arg-type]


class TestSecrets:
    def _kafka(self, tmp_path: Path) -> tuple[KafkaSettings, KafkaConnection]:
        settings = KafkaSettings(
            kafka_security_protocol="SASL_SSL",  # type: ignore[arg-type]
            kafka_sasl_mechanism="SCRAM-SHA-256",  # type: ignore[arg-type]
            kafka_sasl_username="u",
            kafka_sasl_password=PASSWORD,  # type: ignore[arg-type]
        )
        return settings, settings.kafka()

    def test_never_in_repr_or_str(self, tmp_path: Path) -> None:
        settings, kafka = self._kafka(tmp_path)
        for shown in (repr(settings), str(settings), repr(kafka), str(kafka)):
            assert PASSWORD not in shown
            assert "**********" in shown
        assert PASSWORD not in repr(kafka.faust_credentials())

    @pytest.mark.integration
    async def test_never_logged(
        self, sasl_broker: LocalKafkaCluster, caplog: pytest.LogCaptureFixture
    ) -> None:
        """At DEBUG on every logger, a real SASL_SSL broker is given its password (let
        in) and a wrong one (refused): neither is in a log line or in an error's text."""
        for name in LOGGERS:
            caplog.set_level(logging.DEBUG, logger=name)
        right = sasl_broker.connection()
        wrong = sasl_broker.connection(sasl_password=SecretStr(WRONG_PASSWORD))
        assert right.sasl_password is not None
        secrets = {"right": right.sasl_password.get_secret_value(), "wrong": WRONG_PASSWORD}
        logging.getLogger("test").info("connecting with %s (%r) and %r", right, right, wrong)
        errors: list[BaseException] = []

        # The right password: the start check, a producer and faust's producer are let in.
        assert await kafka_connect.check(right, timeout_s=30) is True
        producer = kafka_connect.producer(right, request_timeout_ms=30_000)
        await producer.start()
        await producer.stop()
        app = kafka_connect.faust_app(right, "sg-secret-test")
        await app.producer.start()
        await app.producer.stop()

        # A wrong one: refused by the broker at the SASL step, each time.
        with pytest.raises(ConfigurationError) as refused:
            await kafka_connect.check(wrong, timeout_s=30)
        assert f"refused user {SCRAM_USER!r} (SCRAM-SHA-512)" in str(refused.value)
        errors.append(refused.value)
        producer = kafka_connect.producer(wrong, request_timeout_ms=30_000)
        with pytest.raises(KafkaError) as failed:
            await producer.start()
        await producer.stop()
        errors.append(failed.value)
        app = kafka_connect.faust_app(wrong, "sg-secret-test-wrong")
        with pytest.raises(KafkaError) as failed:
            await app.producer.start()
        await app.producer.stop()
        errors.append(failed.value)

        # The SASL step ran and was logged, at DEBUG too.
        assert f"Authenticated as {SCRAM_USER} via SCRAM-SHA-512" in caplog.text
        assert "SaslAuthenticationFailed" in caplog.text
        assert any(r.levelno == logging.DEBUG and r.name.startswith("aiokafka")
                   for r in caplog.records)  # fmt: skip
        leaks = [f"the {which} password is in the log" for which, secret in secrets.items()
                 if secret in caplog.text]  # fmt: skip
        leaks += [f"the {which} password is in {type(exc).__name__}: {exc}"
                  for which, secret in secrets.items()
                  for exc in errors if secret in _shown(exc)]  # fmt: skip
        assert not leaks, leaks


class TestShortfalls:
    WANTED = KafkaConnection(replication_factor=3, min_insync_replicas=2)

    def test_enough_is_fine(self) -> None:
        found = [TopicReplication("a", 3, 2), TopicReplication("b", 5, 3)]
        assert shortfalls(found, self.WANTED) == []

    def test_each_topic_named_with_what_it_has_and_what_is_wanted(self) -> None:
        found = [TopicReplication("a", 1, 1), TopicReplication("b", 3, 1)]
        assert shortfalls(found, self.WANTED) == [
            "topic a is under-replicated: replication factor 1 < 3 "
            "(SPENDGATE_KAFKA_REPLICATION_FACTOR), min.insync.replicas 1 < 2 "
            "(SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS)",
            "topic b is under-replicated: min.insync.replicas 1 < 2 "
            "(SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS)",
        ]


def _client_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """The calls in ``tree`` that build a Kafka client or a faust app directly (imported
    names followed through ``as``)."""
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "aiokafka",
            "faust",
        ):
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = imported.get(func.id, func.id) if isinstance(func, ast.Name) else ast.unparse(func)
        last = name.rsplit(".", 1)[-1]
        if last in CLIENTS or (last == "App" and name.startswith("faust")):
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
            "build Kafka clients with spendgate.schemas.kafka_connect (producer, consumer, "
            "admin, faust_app), which pass the connection settings:\n" + "\n".join(offenders)
        )

    @pytest.mark.parametrize(
        "source",
        [
            "from aiokafka import AIOKafkaProducer\nAIOKafkaProducer(bootstrap_servers='x')",
            "import aiokafka\naiokafka.AIOKafkaConsumer('t')",
            "from aiokafka.admin import AIOKafkaAdminClient as A\nA()",
            "from spendgate import x\nx.AIOKafkaAdminClient()",
            "import faust\nfaust.App('id')",
            "from faust import App\nApp('id')",
        ],
    )
    def test_the_scan_sees_each_way(self, source: str) -> None:
        assert len(_client_calls(ast.parse(source))) == 1

    def test_the_factory_module_builds_each_kind(self) -> None:
        calls = {call for _, call in _client_calls(ast.parse(FACTORY.read_text()))}
        assert calls == {
            "aiokafka.AIOKafkaProducer",
            "aiokafka.AIOKafkaConsumer",
            "aiokafka.admin.AIOKafkaAdminClient",
            "faust.App",
        }


class TestStartCheck:
    """``kafka_connect.check``/``explain``: which failures name a setting (against real
    brokers: ``tests/test_devkafka_cluster.py``)."""

    def test_refused_credentials_name_the_user_and_password_settings(self) -> None:
        from aiokafka.errors import SaslAuthenticationFailed

        kafka = KafkaConnection(
            bootstrap="b:9093",
            security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username="svc",
            sasl_password=SecretStr("hunter2"),
        )
        error = kafka_connect.explain(SaslAuthenticationFailed("invalid credentials"), kafka)
        assert error is not None
        text = str(error)
        assert "SPENDGATE_KAFKA_SASL_USERNAME" in text and "SASL_PASSWORD_FILE" in text
        assert "hunter2" not in text

    def test_an_untrusted_certificate_names_the_ca_setting(self) -> None:
        import ssl

        exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
        error = kafka_connect.explain(exc, KafkaConnection(security_protocol="SSL"))
        assert error is not None and "SPENDGATE_KAFKA_SSL_CAFILE" in str(error)

    def test_anything_else_names_nothing(self) -> None:
        assert kafka_connect.explain(ConnectionRefusedError(), KafkaConnection()) is None

    async def test_an_unreachable_broker_is_not_an_error(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        assert await kafka_connect.check(KafkaConnection(bootstrap=f"127.0.0.1:{port}")) is False
