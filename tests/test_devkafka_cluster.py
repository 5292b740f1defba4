"""`spendgate dev up --brokers 3 [--security sasl_ssl]`: a real three-broker KRaft cluster.

One cluster per security mode, started for the class of its tests (so one runs at a
time), on ports of its own (neither the default stack's nor the CLI's 29092) in a
temporary folder, stopped at the end. Its start and stop times are printed in the report.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import NewTopic
from aiokafka.errors import KafkaConnectionError
from pydantic import SecretStr

from spendgate.devkafka import (
    KafkaClusterSettings,
    LocalKafkaCluster,
    Security,
    brokers_in_metadata,
    make_ca,
)
from spendgate.schemas import kafka_connect
from spendgate.schemas.connections import check_connections
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.kafka_connect import KafkaConnection, KafkaSettings
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import describe_replication, ensure_topics
from tests.fixtures.services import say

pytestmark = pytest.mark.integration

#: Below the ephemeral range (clients' own ports never take a killed broker's place);
#: controllers at +100, replication listeners at +200: 29400-29502 and 29700-29902.
OWN_PORTS: dict[Security, int] = {"plaintext": 29400, "sasl_ssl": 29700}


def _cluster(
    security: Security, tmp_path_factory: pytest.TempPathFactory, config: pytest.Config
) -> Iterator[LocalKafkaCluster]:
    if shutil.which("java") is None or shutil.which("openssl") is None:
        reason = "java and openssl are needed for the three-broker cluster"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    settings = KafkaClusterSettings(
        kafka_cluster_port=OWN_PORTS[security], stack_dir=tmp_path_factory.mktemp("kafka")
    )
    kafka = LocalKafkaCluster(settings, 3, security)
    started = time.monotonic()
    try:
        kafka.up()
        say(config, f"3-broker {security} cluster up in {time.monotonic() - started:.1f} s")
        yield kafka
    finally:
        stopping = time.monotonic()
        kafka.down()
        say(config, f"3-broker {security} cluster down in {time.monotonic() - stopping:.1f} s")


@pytest.fixture(scope="class")
def plain_cluster(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[LocalKafkaCluster]:
    yield from _cluster("plaintext", tmp_path_factory, pytestconfig)


@pytest.fixture(scope="class")
def sasl_cluster(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[LocalKafkaCluster]:
    yield from _cluster("sasl_ssl", tmp_path_factory, pytestconfig)


@pytest.fixture
def kafka_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No SPENDGATE_KAFKA_* of the outer environment leaks in."""
    for name in list(os.environ):
        if name.startswith("SPENDGATE_KAFKA_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _export(monkeypatch: pytest.MonkeyPatch, lines: list[str]) -> None:
    """Set the variables of ``export NAME=value`` lines, as a shell sourcing them would."""
    for line in lines:
        name, _, value = shlex.split(line.removeprefix("export "))[0].partition("=")
        monkeypatch.setenv(name, value)


async def _produce(kafka: KafkaConnection, topic: str, values: list[bytes]) -> None:
    producer = kafka_connect.producer(
        kafka, acks="all", enable_idempotence=True, request_timeout_ms=30_000
    )
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value)
    finally:
        await producer.stop()


async def _consume(kafka: KafkaConnection, topic: str, count: int, timeout_s: float) -> list[bytes]:
    consumer = kafka_connect.consumer(
        kafka, topic, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    got: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(got) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            got += [r.value for records in batches.values() for r in records if r.value]
    finally:
        await consumer.stop()
    return got


async def _leader(kafka: KafkaConnection, topic: str) -> int:
    admin = kafka_connect.admin(kafka)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
        return int(described["partitions"][0]["leader"])
    finally:
        await admin.close()


def _worker_settings(cluster: LocalKafkaCluster, monkeypatch: pytest.MonkeyPatch) -> WorkerSettings:
    """The worker's settings on this cluster, its replication from the environment."""
    _export(monkeypatch, cluster.env_lines())
    assert os.environ["SPENDGATE_KAFKA_REPLICATION_FACTOR"] == "3"
    assert os.environ["SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS"] == "2"
    return WorkerSettings(topic_prefix=f"t{uuid.uuid4().hex[:8]}.", app_id="devkafka")


class TestThreeBrokers:
    def test_the_metadata_lists_three_brokers(self, plain_cluster: LocalKafkaCluster) -> None:
        assert brokers_in_metadata(plain_cluster.connection()) == [1, 2, 3]
        assert all(s.running for s in plain_cluster.status())

    async def test_topics_are_created_with_replication_3_and_min_insync_2(
        self, plain_cluster: LocalKafkaCluster, kafka_env: pytest.MonkeyPatch
    ) -> None:
        settings = _worker_settings(plain_cluster, kafka_env)
        kafka = settings.kafka()
        assert (kafka.replication_factor, kafka.min_insync_replicas) == (3, 2)
        await ensure_topics(settings)
        await ensure_topics(settings)  # the existing topics pass the replication check
        names = [settings.topic(t) for t in ("usage", "policies", "alerts", "dlq", "refusals")]
        admin = kafka_connect.admin(kafka)
        await admin.start()
        try:
            found = await describe_replication(admin, [*names, settings.keyed_topic])
        finally:
            await admin.close()
        assert {(t.replication_factor, t.min_insync_replicas) for t in found} == {(3, 2)}

    async def test_every_acked_record_survives_a_kill_9_of_the_leader(
        self,
        plain_cluster: LocalKafkaCluster,
        kafka_env: pytest.MonkeyPatch,
        pytestconfig: pytest.Config,
    ) -> None:
        """Runs last on this cluster: it leaves one broker dead."""
        settings = _worker_settings(plain_cluster, kafka_env)
        kafka = settings.kafka()
        await ensure_topics(settings)
        topic = settings.topic("alerts")  # one partition: one leader to kill
        before = [f"before-{i}".encode() for i in range(200)]
        await _produce(kafka, topic, before)
        leader = await _leader(kafka, topic)
        pid = plain_cluster.pid(leader)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        # Acknowledged by the new leader and the other survivor (min.insync.replicas 2).
        after = [f"after-{i}".encode() for i in range(100)]
        await _produce(kafka, topic, after)
        reelected_s = time.monotonic() - killed
        assert await _leader(kafka, topic) != leader
        got = await _consume(kafka, topic, len(before) + len(after), timeout_s=60)
        assert got == before + after
        say(pytestconfig, f"acks=all writes resumed {reelected_s:.1f} s after the kill -9")


class TestSaslSsl:
    async def test_the_printed_environment_connects_with_the_scram_user(
        self, sasl_cluster: LocalKafkaCluster, kafka_env: pytest.MonkeyPatch
    ) -> None:
        lines = sasl_cluster.env_lines()
        password = sasl_cluster.password_file.read_text().strip()
        assert not any(password in line for line in lines)
        for secret in (sasl_cluster.password_file, sasl_cluster.ca_file):
            assert secret.stat().st_mode & 0o777 == 0o600
        _export(kafka_env, lines)
        kafka = KafkaSettings().kafka()
        assert kafka.security_protocol == "SASL_SSL"
        assert kafka.sasl_mechanism == "SCRAM-SHA-512"
        topic = f"t{uuid.uuid4().hex[:8]}.sasl"
        admin = kafka_connect.admin(kafka)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 3)])
        finally:
            await admin.close()
        values = [f"v{i}".encode() for i in range(20)]
        await _produce(kafka, topic, values)
        assert await _consume(kafka, topic, len(values), timeout_s=30) == values

    async def test_a_service_s_start_check_names_the_setting_to_fix(
        self, sasl_cluster: LocalKafkaCluster, tmp_path: Path
    ) -> None:
        # What `spendgate worker`, admission and the dashboard run at start
        # (kafka_connect.check): one line naming the variable, never the password.
        assert await kafka_connect.check(sasl_cluster.connection())
        wrong = sasl_cluster.connection(sasl_password=SecretStr("not-the-password"))
        with pytest.raises(ConfigurationError) as refused:
            await kafka_connect.check(wrong)
        assert "SPENDGATE_KAFKA_SASL_PASSWORD" in str(refused.value)
        assert "not-the-password" not in str(refused.value)
        make_ca(tmp_path / "other.key", tmp_path / "other.pem", "another CA")
        untrusted = sasl_cluster.connection(ssl_cafile=tmp_path / "other.pem")
        with pytest.raises(ConfigurationError, match="SPENDGATE_KAFKA_SSL_CAFILE"):
            await kafka_connect.check(untrusted)
        # The worker's start check runs it before anything else.
        settings = WorkerSettings(
            kafka_bootstrap=wrong.bootstrap,
            kafka_security_protocol="SASL_SSL",
            kafka_sasl_mechanism="SCRAM-SHA-512",
            kafka_sasl_username=wrong.sasl_username,
            kafka_sasl_password=SecretStr("not-the-password"),
            kafka_ssl_cafile=sasl_cluster.ca_file,
        )
        with pytest.raises(ConfigurationError, match="SPENDGATE_KAFKA_SASL_PASSWORD"):
            await check_connections(settings.kafka(), settings.redis())

    async def test_a_wrong_password_fails_authentication(
        self, sasl_cluster: LocalKafkaCluster, caplog: pytest.LogCaptureFixture
    ) -> None:
        kafka = sasl_cluster.connection(sasl_password=SecretStr("not-the-password"))
        producer = kafka_connect.producer(kafka, request_timeout_ms=5000)
        with caplog.at_level(logging.ERROR, "aiokafka"), pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()
        assert "Authentication failed" in caplog.text

    async def test_an_untrusted_ca_fails_the_tls_handshake(
        self,
        sasl_cluster: LocalKafkaCluster,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        make_ca(tmp_path / "other.key", tmp_path / "other.pem", "another CA")
        kafka = sasl_cluster.connection(ssl_cafile=tmp_path / "other.pem")
        producer = kafka_connect.producer(kafka, request_timeout_ms=5000)
        with caplog.at_level(logging.ERROR, "aiokafka"), pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
