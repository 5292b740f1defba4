"""The local stacks refuse ports they do not own and never signal strangers; the
multi-broker stack's layout (its broker runs are in ``test_devkafka_cluster.py``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spendgate.cli import app
from spendgate.devkafka import KafkaClusterSettings, LocalKafkaCluster, Security
from spendgate.devstack import LocalStack, StackSettings
from spendgate.schemas.exceptions import ConfigurationError


class TestLocalStack:
    def test_a_port_taken_by_another_process_is_refused(self, tmp_path: Path) -> None:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            stack = LocalStack(StackSettings(redis_port=port, stack_dir=tmp_path))
            with pytest.raises(ConfigurationError, match=f"port {port}"):
                stack._start_redis()

    def test_down_without_recorded_pids_stops_nothing(self, tmp_path: Path) -> None:
        stack = LocalStack(StackSettings(stack_dir=tmp_path))
        assert stack.down() == []

    def test_a_stale_pidfile_is_ignored(self, tmp_path: Path) -> None:
        stack = LocalStack(StackSettings(stack_dir=tmp_path))
        (tmp_path / "redis.pid").write_text("999999999")
        assert stack.pid("redis") is None

    def test_redis_persists_every_second_and_never_evicts(self, tmp_path: Path) -> None:
        command = LocalStack(StackSettings(stack_dir=tmp_path)).redis_command()
        flags = dict(zip(command[1::2], command[2::2], strict=True))
        assert flags["--appendonly"] == "yes"
        assert flags["--appendfsync"] == "everysec"
        assert flags["--maxmemory-policy"] == "noeviction"
        assert flags["--dir"] == str(tmp_path / "redis")

    def test_wipe_also_deletes_the_redis_append_only_file(self, tmp_path: Path) -> None:
        (tmp_path / "redis" / "appendonlydir").mkdir(parents=True)
        (tmp_path / "kafka" / "data").mkdir(parents=True)
        LocalStack(StackSettings(stack_dir=tmp_path)).wipe()
        assert not (tmp_path / "redis").exists() and not (tmp_path / "kafka" / "data").exists()


class TestKafkaClusterLayout:
    """`dev up --brokers 3 --security sasl_ssl`'s files and ports, without starting a JVM."""

    def _cluster(self, tmp_path: Path, security: Security = "plaintext") -> LocalKafkaCluster:
        return LocalKafkaCluster(
            KafkaClusterSettings(kafka_cluster_port=29092, stack_dir=tmp_path), 3, security
        )

    def test_its_ports_and_folder_are_not_the_default_stacks(self, tmp_path: Path) -> None:
        cluster = self._cluster(tmp_path, "sasl_ssl")
        ports = {p for n in cluster.node_ids for p in cluster._ports(n)}
        default = StackSettings()
        assert len(ports) == 9
        assert not ports & {default.kafka_port, default.kafka_controller_port, default.redis_port}
        assert cluster.dir == tmp_path / "kafka-3-sasl_ssl" != tmp_path / "kafka"

    def test_three_nodes_replicate_every_topic_3_with_min_insync_2(self, tmp_path: Path) -> None:
        props = self._cluster(tmp_path)._server_properties(2)
        assert props["controller.quorum.voters"] == (
            "1@127.0.0.1:29192,2@127.0.0.1:29193,3@127.0.0.1:29194"
        )
        assert props["process.roles"] == "broker,controller"
        for name in (
            "default.replication.factor",
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
            "share.coordinator.state.topic.replication.factor",
        ):
            assert props[name] == "3", name
        for name in (
            "min.insync.replicas",
            "transaction.state.log.min.isr",
            "share.coordinator.state.topic.min.isr",
        ):
            assert props[name] == "2", name

    def test_sasl_ssl_serves_clients_with_scram_and_replicates_on_loopback(
        self, tmp_path: Path
    ) -> None:
        cluster = self._cluster(tmp_path, "sasl_ssl")
        (cluster.dir / "tls").mkdir(parents=True)
        (cluster.dir / "tls" / "keystore-password").write_text("pw")
        props = cluster._server_properties(1)
        assert props["advertised.listeners"] == (
            "SASL_SSL://127.0.0.1:29092,REPLICATION://127.0.0.1:29292"
        )
        assert props["listener.security.protocol.map"] == (
            "SASL_SSL:SASL_SSL,REPLICATION:PLAINTEXT,CONTROLLER:PLAINTEXT"
        )
        assert props["inter.broker.listener.name"] == "REPLICATION"
        assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"

    def test_the_environment_names_the_password_file_not_the_password(self, tmp_path: Path) -> None:
        cluster = self._cluster(tmp_path, "sasl_ssl")
        assert cluster.env_lines() == [
            "export SPENDGATE_KAFKA_BOOTSTRAP=127.0.0.1:29092,127.0.0.1:29093,127.0.0.1:29094",
            "export SPENDGATE_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
            "export SPENDGATE_KAFKA_SASL_MECHANISM=SCRAM-SHA-512",
            "export SPENDGATE_KAFKA_SASL_USERNAME=spendgate",
            f"export SPENDGATE_KAFKA_SASL_PASSWORD_FILE={cluster.dir}/client/password",
            f"export SPENDGATE_KAFKA_SSL_CAFILE={cluster.dir}/client/ca.pem",
            "export SPENDGATE_KAFKA_REPLICATION_FACTOR=3",
            "export SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS=2",
        ]

    def test_the_scram_credential_is_salted_not_the_password(self, tmp_path: Path) -> None:
        cluster = self._cluster(tmp_path, "sasl_ssl")
        cluster.password_file.parent.mkdir(parents=True)
        cluster.password_file.write_text("s3cret-pa55")
        argument = cluster._scram_argument()
        assert argument.startswith("SCRAM-SHA-512=[name=spendgate,iterations=8192,salt=")
        assert "s3cret-pa55" not in argument

    def test_down_without_recorded_pids_stops_nothing(self, tmp_path: Path) -> None:
        assert self._cluster(tmp_path).down() == []

    def test_dev_env_prints_the_lines_of_the_flags(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("SPENDGATE_STACK_DIR", str(tmp_path))
        monkeypatch.delenv("SPENDGATE_KAFKA_CLUSTER_PORT", raising=False)
        monkeypatch.delenv("SPENDGATE_KAFKA_PORT", raising=False)
        runner = CliRunner()
        default = runner.invoke(app, ["dev", "env"])
        assert default.output == "export SPENDGATE_KAFKA_BOOTSTRAP=127.0.0.1:9092\n"
        secured = runner.invoke(app, ["dev", "env", "--brokers", "3", "--security", "sasl_ssl"])
        assert secured.output.splitlines() == self._cluster(tmp_path, "sasl_ssl").env_lines()
