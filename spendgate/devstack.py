"""The local stack without Docker: Apache Kafka from Maven Central jars and a Redis server.

Kafka 4.1.1 is pinned: the newest 4.x line whose combined KRaft mode runs on the Java 17
these machines ship, whose log4j (2.24.3) and slf4j (1.7.x) bindings are known to work
from Maven artifacts, and which aiokafka >= 0.13 speaks (Kafka 4 dropped old protocols).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from spendgate.schemas.exceptions import ConfigurationError

KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.24.3"

Service = Literal["kafka", "redis"]
SERVICES: tuple[Service, ...] = ("kafka", "redis")


class StackSettings(BaseSettings):
    """Ports and folders of the local stack (environment prefix ``SPENDGATE_``)."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    kafka_port: int = Field(
        9092, ge=1, le=65535, description="`dev up`: the local Kafka broker's client port."
    )
    kafka_controller_port: int = Field(
        9093, ge=1, le=65535, description="`dev up`: the local Kafka's KRaft controller port."
    )
    redis_port: int = Field(6379, ge=1, le=65535, description="`dev up`: the local Redis's port.")
    cache_dir: Path = Field(
        Path.home() / ".cache" / "spendgate",
        description="Where the Kafka jars fetched from Maven Central are cached (re-used).",
    )
    stack_dir: Path = Field(
        Path.home() / ".local" / "state" / "spendgate" / "stack",
        description="Where the local stack keeps its data, pid files and logs.",
    )
    kafka_heap: str = Field(
        "512m", description="`dev up`: the local Kafka's JVM heap (`-Xms` and `-Xmx`)."
    )
    start_timeout_s: float = Field(
        90.0, description="`dev up`: how long to wait for Kafka and Redis to answer."
    )

    @property
    def kafka_libs(self) -> Path:
        """Where the Kafka jars are cached (outside the source tree, re-used)."""
        return self.cache_dir / f"kafka-{KAFKA_VERSION}" / "libs"


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    """What ``dev status`` reports for one service."""

    name: Service
    pid: int | None
    port: int
    running: bool
    log: Path


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as dead.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def recorded_pid(path: Path) -> int | None:
    """The pid in ``path`` when that process still runs; a stale pid file is removed."""
    if not path.exists():
        return None
    pid = int(path.read_text().strip() or 0)
    if pid and alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def stop_pid(pid: int, grace_s: float) -> None:
    """SIGTERM ``pid``, reap it while it exits, and SIGKILL it after ``grace_s``."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


def redis_binary() -> str:
    """The ``redis-server`` on PATH; as root on Debian, installed with apt first when missing."""
    found = shutil.which("redis-server")
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run([apt, "-qq", "update"], check=False, capture_output=True, env=env)
        subprocess.run(
            [apt, "install", "-y", "-qq", "redis-server"],
            check=True,
            capture_output=True,
            env=env,
        )
        found = shutil.which("redis-server")
        if found:
            return found
    raise ConfigurationError(
        "redis-server is not installed: run `sudo apt-get install redis-server` "
        "(Debian/Ubuntu) or install Redis >= 7 and put redis-server on PATH"
    )


class LocalStack:
    """Starts, stops and reports the Kafka broker and Redis server this tool owns.

    Only processes whose pid this class recorded are ever signalled.
    """

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.dir = settings.stack_dir

    # -- bookkeeping -------------------------------------------------------------------------
    def _pidfile(self, name: Service) -> Path:
        return self.dir / f"{name}.pid"

    def log_path(self, name: Service) -> Path:
        """The log file of one service."""
        return self.dir / "logs" / f"{name}.log"

    def pid(self, name: Service) -> int | None:
        """The recorded pid of a service this tool started and that still runs."""
        return recorded_pid(self._pidfile(name))

    def _port(self, name: Service) -> int:
        return self.settings.kafka_port if name == "kafka" else self.settings.redis_port

    def status(self) -> list[ServiceStatus]:
        """One line of truth per service."""
        out = []
        for name in SERVICES:
            pid = self.pid(name)
            port = self._port(name)
            running = pid is not None and port_open(port)
            out.append(ServiceStatus(name, pid, port, running, self.log_path(name)))
        return out

    def _refuse_foreign_port(self, name: Service, *ports: int) -> None:
        for port in ports:
            if port_open(port):
                raise ConfigurationError(
                    f"port {port} (for {name}) is already in use by a process spendgate did not "
                    f"start; stop it or choose another port (SPENDGATE_"
                    f"{'REDIS' if name == 'redis' else 'KAFKA'}_PORT)"
                )

    # -- Kafka -------------------------------------------------------------------------------
    def fetch_kafka(self) -> Path:
        """Download Kafka and its runtime classpath with Maven, once; return the libs folder."""
        libs = self.settings.kafka_libs
        marker = libs / ".complete"
        if marker.exists():
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise ConfigurationError(
                "Maven (mvn) is needed once to fetch Kafka from Maven Central: "
                "apt-get install maven (and a JDK 17+: apt-get install openjdk-17-jre-headless)"
            )
        work = libs.parent
        work.mkdir(parents=True, exist_ok=True)
        pom = resources.files("spendgate").joinpath("kafka-pom.xml").read_text()
        pom = pom.replace(
            "<kafka.version>4.1.1</kafka.version>",
            f"<kafka.version>{KAFKA_VERSION}</kafka.version>",
        )
        (work / "pom.xml").write_text(pom)
        cmd = [
            mvn,
            "-q",
            "-B",
            "-f",
            str(work / "pom.xml"),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={libs}",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ConfigurationError(
                f"fetching Kafka {KAFKA_VERSION} with Maven failed:\n{result.stdout[-2000:]}"
                f"{result.stderr[-2000:]}"
            )
        marker.write_text(KAFKA_VERSION)
        return libs

    def _java(self) -> str:
        java = shutil.which("java")
        if java is None:
            raise ConfigurationError(
                "Java 17+ is needed for Kafka: apt-get install openjdk-17-jre-headless"
            )
        return java

    def _kafka_config(self) -> Path:
        s = self.settings
        kdir = self.dir / "kafka"
        data = kdir / "data"
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{s.kafka_controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{s.kafka_port},"
            f"CONTROLLER://127.0.0.1:{s.kafka_controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{s.kafka_port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(data),
            "num.partitions": "4",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "log.cleaner.dedupe.buffer.size": str(4 * 1024 * 1024),
            "auto.create.topics.enable": "true",
        }
        kdir.mkdir(parents=True, exist_ok=True)
        config = kdir / "server.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (kdir / "log4j2.properties").write_text(
            "status = warn\n"
            "appender.file.type = File\n"
            "appender.file.name = file\n"
            f"appender.file.fileName = {self.log_path('kafka')}\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = INFO\n"
            "rootLogger.appenderRef.file.ref = file\n"
            "logger.kafka.name = kafka\nlogger.kafka.level = INFO\n"
            "logger.state.name = state.change.logger\nlogger.state.level = WARN\n"
        )
        return config

    def _start_kafka(self) -> int:
        s = self.settings
        libs = self.fetch_kafka()
        self._refuse_foreign_port("kafka", s.kafka_port, s.kafka_controller_port)
        config = self._kafka_config()
        java = self._java()
        classpath = f"{libs}/*"
        log4j = f"-Dlog4j2.configurationFile={self.dir / 'kafka' / 'log4j2.properties'}"
        # Format once; later `dev up`s keep the topics (`dev down --wipe` starts afresh).
        if not (self.dir / "kafka" / "data" / "meta.properties").exists():
            uuid = (
                subprocess.run(
                    [java, "-cp", classpath, log4j, "kafka.tools.StorageTool", "random-uuid"],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            subprocess.run(
                [
                    java,
                    "-cp",
                    classpath,
                    log4j,
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    uuid,
                    "-c",
                    str(config),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
        log = self.log_path("kafka")
        cmd = [
            java,
            f"-Xms{s.kafka_heap}",
            f"-Xmx{s.kafka_heap}",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={log.parent}",
            log4j,
            "-cp",
            classpath,
            "kafka.Kafka",
            str(config),
        ]
        with open(log.with_suffix(".out"), "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return proc.pid

    def _kafka_ready(self) -> bool:
        from spendgate._kafka_probe import metadata_ok
        from spendgate.schemas.kafka_connect import KafkaConnection

        # The dev stack's own broker: PLAINTEXT on loopback, whatever the environment says.
        return port_open(self.settings.kafka_port) and metadata_ok(
            KafkaConnection(bootstrap=f"127.0.0.1:{self.settings.kafka_port}")
        )

    # -- Redis -------------------------------------------------------------------------------
    def redis_command(self, binary: str = "redis-server") -> list[str]:
        """The ``redis-server`` command line of the stack (persistent, never evicting)."""
        s = self.settings
        return [
            binary,
            "--port",
            str(s.redis_port),
            "--bind",
            "127.0.0.1",
            # Pending reservations and the windows between two worker writes live only
            # here: log every write, fsync each second, and refuse rather than evict.
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
            "--dir",
            str(self.dir / "redis"),
            "--logfile",
            str(self.log_path("redis")),
            "--daemonize",
            "no",
        ]

    def _start_redis(self) -> int:
        binary = redis_binary()
        self._refuse_foreign_port("redis", self.settings.redis_port)
        (self.dir / "redis").mkdir(parents=True, exist_ok=True)
        cmd = self.redis_command(binary)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        return proc.pid

    def _redis_ready(self) -> bool:
        if not port_open(self.settings.redis_port):
            return False
        with socket.create_connection(("127.0.0.1", self.settings.redis_port), 1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    # -- lifecycle ---------------------------------------------------------------------------
    def up(self, services: tuple[Service, ...] = SERVICES) -> list[ServiceStatus]:
        """Start whatever of ``services`` is not running yet and wait until they answer
        (``dev up --brokers 3`` starts only Redis here: its Kafka is :mod:`devkafka`'s).

        Raises:
            ConfigurationError: a port is taken by a stranger, or a tool is missing.
            TimeoutError: a service did not become ready in time (see its log).
        """
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        starters: dict[Service, tuple[Callable[[], int], Callable[[], bool]]] = {
            "redis": (self._start_redis, self._redis_ready),
            "kafka": (self._start_kafka, self._kafka_ready),
        }
        starters = {name: both for name, both in starters.items() if name in services}
        for name, (start, _) in starters.items():
            if self.pid(name) is None:
                pid = start()
                self._pidfile(name).write_text(str(pid))
        deadline = time.monotonic() + self.settings.start_timeout_s
        for name, (_, ready) in starters.items():
            while not ready():
                if self.pid(name) is None:
                    raise TimeoutError(f"{name} exited during start; see {self.log_path(name)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not ready in time; see {self.log_path(name)}")
                time.sleep(0.5)
        return self.status()

    def wipe(self) -> None:
        """Delete the broker's data and Redis's append-only file (call after :meth:`down`).

        The next ``up`` formats anew; Redis state derived from the old topics goes with
        them. Worker table folders built against the old broker must be wiped too.
        """
        shutil.rmtree(self.dir / "kafka" / "data", ignore_errors=True)
        shutil.rmtree(self.dir / "redis", ignore_errors=True)

    def down(self) -> list[Service]:
        """Stop the services this tool started (SIGTERM, then SIGKILL after 30 s)."""
        stopped: list[Service] = []
        for name in SERVICES:
            pid = self.pid(name)
            if pid is None:
                continue
            stop_pid(pid, 30)
            self._pidfile(name).unlink(missing_ok=True)
            stopped.append(name)
        return stopped
