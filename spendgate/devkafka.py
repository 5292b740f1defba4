"""A multi-broker and/or SASL_SSL Kafka on loopback (``spendgate dev up --brokers 3
--security sasl_ssl``), beside the one-broker stack of ``spendgate dev up``.

Each node is a combined KRaft broker and controller from the same Maven jars as the
default stack, with static voters (no dynamic-quorum format flags). Ports count from
``SPENDGATE_KAFKA_CLUSTER_PORT`` (29092): node ``i`` (0-based) serves clients on
``base + i``, its controller on ``base + 100 + i`` and, with ``sasl_ssl``, replication on
``base + 200 + i``. The state folder is ``<stack_dir>/kafka-<brokers>-<security>``: one per
shape, so switching shapes never reads another's data.

With ``sasl_ssl`` clients connect over SASL_SSL with SCRAM-SHA-512; the brokers replicate
and the controllers talk over PLAINTEXT listeners bound to 127.0.0.1 only (a dev stack:
TLS between JVMs on one host would cost CPU and prove nothing about the clients). A CA
and one broker certificate (SAN 127.0.0.1 and localhost) are made with openssl; the SCRAM
user is written into the metadata at format time as a salted password, so the password
itself is on no command line. Only processes whose pid this module recorded are signalled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from spendgate.devstack import LocalStack, StackSettings, port_open, recorded_pid, stop_pid
from spendgate.schemas import kafka_connect
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.kafka_connect import KafkaConnection

Security = Literal["plaintext", "sasl_ssl"]
SECURITIES: tuple[Security, ...] = ("plaintext", "sasl_ssl")
#: The SCRAM user created at format time (its password: ``client/password``).
SCRAM_USER = "spendgate"
#: Kafka's floor for SCRAM-SHA-512 is 4096 iterations.
SCRAM_ITERATIONS = 8192


class KafkaClusterSettings(BaseSettings):
    """Ports and folders of the multi-broker stack (environment prefix ``SPENDGATE_``)."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    kafka_cluster_port: int = Field(
        29092,
        ge=1,
        le=32000,
        description="`dev up --brokers N`: node 0's client port, node i on port + i; "
        "controllers at +100, replication listeners at +200. Below the ephemeral range, so "
        "no client's own port takes a stopped broker's place.",
    )
    cache_dir: Path = Field(
        StackSettings.model_fields["cache_dir"].default,
        description="Where the Kafka jars fetched from Maven Central are cached (re-used).",
    )
    stack_dir: Path = Field(
        StackSettings.model_fields["stack_dir"].default,
        description="Where the local stack keeps its data, pid files and logs.",
    )
    kafka_cluster_heap: str = Field(
        "384m", description="`dev up --brokers N`: each node's JVM heap (`-Xms` and `-Xmx`)."
    )
    start_timeout_s: float = Field(
        150.0, description="`dev up --brokers N`: how long to wait for the nodes to answer."
    )


@dataclass(frozen=True, slots=True)
class BrokerStatus:
    """One node as ``dev status --brokers N`` shows it."""

    node_id: int
    pid: int | None
    port: int
    running: bool
    log: Path


class LocalKafkaCluster:
    """Starts, stops and reports the nodes of one shape (``brokers`` x ``security``).

    Args:
        settings: ports, folders and heap.
        brokers: how many combined broker+controller nodes (3 for a quorum that
            survives one loss).
        security: ``plaintext``, or ``sasl_ssl`` (SCRAM-SHA-512 over TLS for clients).
    """

    def __init__(self, settings: KafkaClusterSettings, brokers: int, security: Security) -> None:
        if brokers < 1:
            raise ConfigurationError(f"--brokers must be at least 1 (got {brokers})")
        self.settings = settings
        self.brokers = brokers
        self.security = security
        self.dir = settings.stack_dir / f"kafka-{brokers}-{security}"
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- layout --------------------------------------------------------------------------------
    @property
    def node_ids(self) -> list[int]:
        """KRaft node ids, 1-based."""
        return list(range(1, self.brokers + 1))

    def port(self, node_id: int) -> int:
        """The client listener of one node."""
        return self.settings.kafka_cluster_port + node_id - 1

    def controller_port(self, node_id: int) -> int:
        """The controller listener of one node."""
        return self.settings.kafka_cluster_port + 100 + node_id - 1

    def replication_port(self, node_id: int) -> int:
        """The inter-broker listener of one node (``sasl_ssl`` only)."""
        return self.settings.kafka_cluster_port + 200 + node_id - 1

    def _ports(self, node_id: int) -> list[int]:
        ports = [self.port(node_id), self.controller_port(node_id)]
        if self.security == "sasl_ssl":
            ports.append(self.replication_port(node_id))
        return ports

    @property
    def bootstrap(self) -> str:
        """Every node's client listener."""
        return ",".join(f"127.0.0.1:{self.port(n)}" for n in self.node_ids)

    @property
    def replication_factor(self) -> int:
        """Of every topic the brokers create (3 once there are 3 nodes)."""
        return min(3, self.brokers)

    @property
    def min_insync_replicas(self) -> int:
        """Of every topic the brokers create (2 once there are 3 nodes)."""
        return min(2, self.brokers)

    @property
    def ca_file(self) -> Path:
        """The CA clients trust (mode 600)."""
        return self.dir / "client" / "ca.pem"

    @property
    def password_file(self) -> Path:
        """The SCRAM user's password (mode 600)."""
        return self.dir / "client" / "password"

    def log_path(self, node_id: int) -> Path:
        """The log file of one node."""
        return self.dir / "logs" / f"broker-{node_id}.log"

    def _node_dir(self, node_id: int) -> Path:
        return self.dir / f"node-{node_id}"

    def _pidfile(self, node_id: int) -> Path:
        return self.dir / f"node-{node_id}.pid"

    def pid(self, node_id: int) -> int | None:
        """The recorded pid of a node this module started and that still runs."""
        return recorded_pid(self._pidfile(node_id))

    # -- what clients use ----------------------------------------------------------------------
    def connection(self, **overrides: object) -> KafkaConnection:
        """The connection a client of this stack uses (replication 3 / 2 with 3 nodes);
        ``overrides`` replace fields (a wrong password, another CA) in tests."""
        fields: dict[str, object] = {
            "bootstrap": self.bootstrap,
            "replication_factor": self.replication_factor,
            "min_insync_replicas": self.min_insync_replicas,
        }
        if self.security == "sasl_ssl":
            fields |= {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_username": SCRAM_USER,
                "sasl_password": SecretStr(self.password_file.read_text().strip()),
                "ssl_cafile": self.ca_file,
            }
        return KafkaConnection.model_validate(fields | overrides)

    def env_lines(self) -> list[str]:
        """The ``export SPENDGATE_KAFKA_*=...`` lines that point spendgate at this stack
        (the password as a file path, never its value)."""
        env = {"BOOTSTRAP": self.bootstrap}
        if self.security == "sasl_ssl":
            env |= {
                "SECURITY_PROTOCOL": "SASL_SSL",
                "SASL_MECHANISM": "SCRAM-SHA-512",
                "SASL_USERNAME": SCRAM_USER,
                "SASL_PASSWORD_FILE": str(self.password_file),
                "SSL_CAFILE": str(self.ca_file),
            }
        env |= {
            "REPLICATION_FACTOR": str(self.replication_factor),
            "MIN_INSYNC_REPLICAS": str(self.min_insync_replicas),
        }
        return [f"export SPENDGATE_KAFKA_{k}={shlex.quote(v)}" for k, v in env.items()]

    # -- files ---------------------------------------------------------------------------------
    def _server_properties(self, node_id: int) -> dict[str, str]:
        rf, isr = str(self.replication_factor), str(self.min_insync_replicas)
        voters = ",".join(f"{n}@127.0.0.1:{self.controller_port(n)}" for n in self.node_ids)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node_id),
            "controller.quorum.voters": voters,
            "controller.listener.names": "CONTROLLER",
            "log.dirs": str(self._node_dir(node_id) / "data"),
            "num.partitions": "4",
            "default.replication.factor": rf,
            "min.insync.replicas": isr,
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
            "group.initial.rebalance.delay.ms": "0",
            "log.cleaner.dedupe.buffer.size": str(4 * 1024 * 1024),
            "auto.create.topics.enable": "true",
            # Three JVMs share two cores: fewer threads each, and a dead broker fenced
            # (its partitions led elsewhere) within a few seconds rather than nine.
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "broker.heartbeat.interval.ms": "1000",
            "broker.session.timeout.ms": "6000",
        }
        port, cport = self.port(node_id), self.controller_port(node_id)
        if self.security == "plaintext":
            props |= {
                "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
                "inter.broker.listener.name": "PLAINTEXT",
                "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            }
            return props
        rport = self.replication_port(node_id)
        tls = self.dir / "tls"
        store_password = (tls / "keystore-password").read_text().strip()
        props |= {
            "listeners": f"SASL_SSL://127.0.0.1:{port},REPLICATION://127.0.0.1:{rport},"
            f"CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{port},REPLICATION://127.0.0.1:{rport}",
            "inter.broker.listener.name": "REPLICATION",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,REPLICATION:PLAINTEXT,"
            "CONTROLLER:PLAINTEXT",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(tls / "broker.p12"),
            "ssl.keystore.password": store_password,
            "ssl.key.password": store_password,
            "ssl.client.auth": "none",
        }
        return props

    def _write_configs(self, node_id: int) -> Path:
        ndir = self._node_dir(node_id)
        ndir.mkdir(parents=True, exist_ok=True)
        config = ndir / "server.properties"
        text = "".join(f"{k}={v}\n" for k, v in self._server_properties(node_id).items())
        _write_private(config, text)  # holds the keystore password with sasl_ssl
        (ndir / "log4j2.properties").write_text(
            "status = warn\n"
            "appender.file.type = File\n"
            "appender.file.name = file\n"
            f"appender.file.fileName = {self.log_path(node_id)}\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = INFO\n"
            "rootLogger.appenderRef.file.ref = file\n"
            "logger.kafka.name = kafka\nlogger.kafka.level = INFO\n"
            "logger.state.name = state.change.logger\nlogger.state.level = WARN\n"
        )
        return config

    def _make_tls(self) -> None:
        """The CA, the brokers' certificate in a PKCS12 keystore, and the client's CA copy
        and password (each secret mode 600); kept across ``up``s, gone with ``wipe``."""
        tls, client = self.dir / "tls", self.dir / "client"
        if (tls / "broker.p12").exists() and self.ca_file.exists() and self.password_file.exists():
            return
        tls.mkdir(parents=True, exist_ok=True, mode=0o700)
        client.mkdir(parents=True, exist_ok=True, mode=0o700)
        make_ca(tls / "ca.key", tls / "ca.pem", "spendgate dev CA")
        store_password = secrets.token_urlsafe(24)
        _write_private(tls / "keystore-password", store_password)
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tls / "broker.key"),
            "-out", str(tls / "broker.csr"), "-subj", "/CN=localhost",
        )  # fmt: skip
        (tls / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl(
            "x509", "-req", "-in", str(tls / "broker.csr"), "-CA", str(tls / "ca.pem"),
            "-CAkey", str(tls / "ca.key"), "-CAcreateserial", "-days", "825", "-sha256",
            "-extfile", str(tls / "san.ext"), "-out", str(tls / "broker.pem"),
        )  # fmt: skip
        _openssl(
            "pkcs12", "-export", "-in", str(tls / "broker.pem"), "-inkey",
            str(tls / "broker.key"), "-certfile", str(tls / "ca.pem"), "-name", "broker",
            "-out", str(tls / "broker.p12"), "-passout", "file:" + str(tls / "keystore-password"),
        )  # fmt: skip
        for secret in ("ca.key", "broker.key", "broker.p12"):
            (tls / secret).chmod(0o600)
        _write_private(self.ca_file, (tls / "ca.pem").read_text())
        _write_private(self.password_file, secrets.token_urlsafe(24))

    def _scram_argument(self) -> str:
        """``--add-scram`` with a salted password (SCRAM's Hi(): PBKDF2-HMAC-SHA512), so the
        password is on no command line."""
        password = self.password_file.read_text().strip().encode()
        salt = os.urandom(24)
        salted = hashlib.pbkdf2_hmac("sha512", password, salt, SCRAM_ITERATIONS)
        b64 = base64.b64encode
        return (
            f"SCRAM-SHA-512=[name={SCRAM_USER},iterations={SCRAM_ITERATIONS},"
            f'salt="{b64(salt).decode()}",saltedpassword="{b64(salted).decode()}"]'
        )

    def _cluster_id(self) -> str:
        path = self.dir / "cluster-id"
        if not path.exists():
            # Kafka's Uuid: 16 random bytes, base64url without padding, not starting with "-".
            while (uuid := base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("="))[0] == "-":
                pass
            path.write_text(uuid)
        return path.read_text().strip()

    def _format(self, libs: Path, java: str, nodes: list[int]) -> None:
        """Format the nodes' storage, in parallel (one JVM each), SCRAM user included."""
        extra = ["--add-scram", self._scram_argument()] if self.security == "sasl_ssl" else []
        cluster_id = self._cluster_id()
        procs = []
        for node_id in nodes:
            log4j = f"-Dlog4j2.configurationFile={self._node_dir(node_id) / 'log4j2.properties'}"
            config = self._node_dir(node_id) / "server.properties"
            cmd = [java, "-Xshare:auto", "-XX:TieredStopAtLevel=1", "-cp", f"{libs}/*", log4j]
            cmd += ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config)]
            procs.append(
                (
                    node_id,
                    subprocess.Popen(cmd + extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
                )
            )
        for node_id, proc in procs:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise ConfigurationError(
                    f"formatting node {node_id} failed: {out.decode(errors='replace')[-2000:]}"
                )

    # -- lifecycle -----------------------------------------------------------------------------
    def _start_node(self, libs: Path, java: str, node_id: int) -> int:
        log = self.log_path(node_id)
        log4j = f"-Dlog4j2.configurationFile={self._node_dir(node_id) / 'log4j2.properties'}"
        heap = self.settings.kafka_cluster_heap
        cmd = [
            java, f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true", f"-Dkafka.logs.dir={log.parent}", log4j,
            "-cp", f"{libs}/*", "kafka.Kafka", str(self._node_dir(node_id) / "server.properties"),
        ]  # fmt: skip
        with open(log.with_suffix(".out"), "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._pidfile(node_id).write_text(str(proc.pid))
        self._children[node_id] = proc
        return proc.pid

    def up(self) -> list[BrokerStatus]:
        """Fetch Kafka (once), make the TLS material and format (once), start the nodes that
        are not running, and wait until every broker is in the cluster's metadata.

        Raises:
            ConfigurationError: a port is taken by a stranger, or a tool is missing.
            TimeoutError: the brokers did not all register in time (see their logs).
        """
        s = self.settings
        stack = LocalStack(StackSettings(cache_dir=s.cache_dir, stack_dir=s.stack_dir))
        libs = stack.fetch_kafka()
        java = stack._java()
        to_start = [n for n in self.node_ids if self.pid(n) is None]
        for node_id in to_start:
            for port in self._ports(node_id):
                if port_open(port):
                    raise ConfigurationError(
                        f"port {port} (Kafka node {node_id}) is in use by a process spendgate "
                        "did not start; stop it or choose other ports "
                        "(SPENDGATE_KAFKA_CLUSTER_PORT)"
                    )
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.security == "sasl_ssl":
            if shutil.which("openssl") is None:
                raise ConfigurationError(
                    "openssl is needed for --security sasl_ssl (Debian: openssl)"
                )
            self._make_tls()
        for node_id in self.node_ids:
            self._write_configs(node_id)
        unformatted = [
            n for n in to_start if not (self._node_dir(n) / "data" / "meta.properties").exists()
        ]
        if unformatted:
            self._format(libs, java, unformatted)
        for node_id in to_start:
            self._start_node(libs, java, node_id)
        self.wait_ready(time.monotonic() + s.start_timeout_s)
        return self.status()

    def wait_ready(self, deadline: float) -> None:
        """Wait until every node's client port answers and the metadata lists every broker.

        Raises:
            TimeoutError: past ``deadline`` (``time.monotonic()``), or a node exited.
        """
        while True:
            if all(port_open(self.port(n)) for n in self.node_ids) and (
                len(brokers_in_metadata(self.connection())) == self.brokers
            ):
                return
            for node_id in self.node_ids:
                if self.pid(node_id) is None:
                    raise TimeoutError(
                        f"Kafka node {node_id} exited during start; see {self.log_path(node_id)}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Kafka brokers are not all up; see the logs in {self.dir / 'logs'}"
                )
            time.sleep(0.5)

    def status(self) -> list[BrokerStatus]:
        """One line per node."""
        out = []
        for node_id in self.node_ids:
            pid = self.pid(node_id)
            port = self.port(node_id)
            running = pid is not None and port_open(port)
            out.append(BrokerStatus(node_id, pid, port, running, self.log_path(node_id)))
        return out

    def down(self) -> list[int]:
        """Stop the nodes this module started (SIGTERM to all at once, SIGKILL after 30 s);
        the ids of those stopped.

        All at once: a node stopped after its peers waits for a controller quorum to
        acknowledge its controlled shutdown, and none is left to answer.
        """
        pids = {n: pid for n in self.node_ids if (pid := self.pid(n)) is not None}
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for node_id, pid in pids.items():
            with contextlib.suppress(ProcessLookupError):  # already gone
                stop_pid(pid, max(0.0, deadline - time.monotonic()))
            self._pidfile(node_id).unlink(missing_ok=True)
        for child in self._children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)
        self._children.clear()
        return list(pids)

    def detach(self) -> None:
        """Leave the nodes running beyond this object (``dev up``): found again by their
        pid files, not waited for."""
        for child in self._children.values():
            if child.poll() is None:
                child.returncode = 0
        self._children.clear()

    def wipe(self) -> None:
        """Delete this shape's folder: data, certificates and password (after :meth:`down`)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def brokers_in_metadata(kafka: KafkaConnection) -> list[int]:
    """The node ids of the brokers the cluster's metadata lists (empty when it does not
    answer)."""

    async def ask() -> list[int]:
        admin = kafka_connect.admin(kafka, request_timeout_ms=3000)
        try:
            await admin.start()
            described = await admin.describe_cluster()
            return sorted(int(b["node_id"]) for b in described["brokers"])
        except Exception:  # noqa: BLE001 - any failure means "not ready yet"
            return []
        finally:
            await admin.close()

    return asyncio.run(ask())


def make_ca(key: Path, cert: Path, name: str) -> None:
    """A self-signed CA (RSA 2048, ten years) with openssl; the key mode 600."""
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
        str(cert), "-days", "3650", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
    )  # fmt: skip
    key.chmod(0o600)


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigurationError(f"openssl {args[0]} failed: {done.stderr[-2000:]}")


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    path.chmod(0o600)
