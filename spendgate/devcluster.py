"""A Redis Cluster on loopback for development and the cluster tests, without Docker.

Three masters with one replica each by default (``redis-server --cluster-enabled yes``,
joined by ``redis-cli --cluster create``), on consecutive ports from
``SPENDGATE_CLUSTER_PORT`` (7100: 7100-7105). Each node keeps an append-only file fsynced
every second and never evicts, like the single Redis of ``spendgate dev up``. Only
processes whose pid this module recorded are ever signalled.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from spendgate.devstack import StackSettings, port_open, recorded_pid, redis_binary, stop_pid
from spendgate.schemas import redis_connect
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.redis_connect import RedisConnection


class ClusterSettings(BaseSettings):
    """Ports and folder of the local cluster (environment prefix ``SPENDGATE_``)."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    cluster_port: int = Field(
        7100,
        ge=1,
        le=55000,
        description="`dev cluster`: the first node's port, the others on the next ones. Keep "
        "it and its cluster bus (port + 10000) below the ephemeral range, where no client's "
        "own port can take a node's place.",
    )
    cluster_masters: int = Field(3, ge=3, le=16, description="`dev cluster`: the masters.")
    cluster_replicas: int = Field(
        1, ge=0, le=2, description="`dev cluster`: replicas of each master."
    )
    cluster_node_timeout_ms: int = Field(
        2000,
        ge=500,
        description="`dev cluster`: how long a master may be unreachable before its replica "
        "is promoted (ms).",
    )
    stack_dir: Path = Field(
        StackSettings.model_fields["stack_dir"].default,
        description="Where the local stack keeps its data, pid files and logs.",
    )
    start_timeout_s: float = Field(
        60.0, description="`dev cluster up`: how long to wait for the cluster to form."
    )


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """One node as ``dev cluster status`` shows it."""

    port: int
    pid: int | None
    running: bool
    role: str  # "master", "replica" or "-" (not answering)
    log: Path


class LocalCluster:
    """Starts, stops and reports the cluster's nodes; repairs one after a test killed it."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.dir = settings.stack_dir / "cluster"
        #: The nodes this object started, reaped by :meth:`down` (a CLI run leaves them).
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def ports(self) -> list[int]:
        """Every node's port, masters first as created."""
        s = self.settings
        count = s.cluster_masters * (1 + s.cluster_replicas)
        return [s.cluster_port + i for i in range(count)]

    @property
    def url(self) -> str:
        """A URL naming the cluster (any node serves as the entry point)."""
        return f"redis://127.0.0.1:{self.settings.cluster_port}/0"

    def log_path(self, port: int) -> Path:
        """The log file of one node."""
        return self.dir / "logs" / f"redis-{port}.log"

    def _pidfile(self, port: int) -> Path:
        return self.dir / f"redis-{port}.pid"

    def pid(self, port: int) -> int | None:
        """The recorded pid of a node this module started and that still runs."""
        return recorded_pid(self._pidfile(port))

    def command(self, port: int, binary: str = "redis-server") -> list[str]:
        """The ``redis-server`` command line of one node."""
        return [
            binary,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(self.settings.cluster_node_timeout_ms),
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--dir", str(self.dir / str(port)),
            "--logfile", str(self.log_path(port)),
            "--daemonize", "no",
        ]  # fmt: skip

    def start_node(self, port: int) -> int:
        """Start one node (its data folder and cluster config kept: it rejoins)."""
        if self.pid(port) is not None:
            raise ConfigurationError(f"cluster node {port} is already running")
        earlier = self._children.pop(port, None)
        if earlier is not None:
            earlier.poll()  # reap the node that died
        if port_open(port):
            raise ConfigurationError(
                f"port {port} (cluster node) is in use by a process spendgate did not start; "
                "stop it or choose other ports (SPENDGATE_CLUSTER_PORT)"
            )
        (self.dir / str(port)).mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            self.command(port, redis_binary()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._pidfile(port).write_text(str(proc.pid))
        self._children[port] = proc
        return proc.pid

    def _client(self, port: int) -> redis.Redis:
        node = RedisConnection(url=f"redis://localhost:{port}/0")
        return redis_connect.client(node, socket_timeout=2, socket_connect_timeout=1)

    def _info(self, port: int) -> dict[str, str]:
        with contextlib.closing(self._client(port)) as client:
            text = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        raw = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in raw.split() if ":" in line)

    def role(self, port: int) -> str:
        """``master`` or ``replica`` as the node says (``-`` when it does not answer)."""
        try:
            with contextlib.closing(self._client(port)) as client:
                kind = client.role()[0]
        except (redis.RedisError, OSError):
            return "-"
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        return "replica" if kind == "slave" else kind

    def healthy(self) -> bool:
        """Every node answers, every slot is served, and each master has its replicas."""
        try:
            infos = [self._info(port) for port in self.ports]
            roles = [self.role(port) for port in self.ports]
        except (redis.RedisError, OSError):
            return False
        s = self.settings
        return (
            all(i.get("cluster_state") == "ok" for i in infos)
            and all(i.get("cluster_slots_ok") == "16384" for i in infos)
            and all(i.get("cluster_known_nodes") == str(len(self.ports)) for i in infos)
            and roles.count("master") == s.cluster_masters
            and roles.count("replica") == s.cluster_masters * s.cluster_replicas
            and all(
                self._replica_synced(p)
                for p, r in zip(self.ports, roles, strict=True)
                if r == "replica"
            )
        )

    def _replica_synced(self, port: int) -> bool:
        with contextlib.closing(self._client(port)) as client:
            info = client.info("replication")
        return info.get("master_link_status") == "up"

    def answers(self, port: int) -> bool:
        """Whether the node answers ``CLUSTER INFO``: it is up and has loaded its data
        (``ROLE`` answers while a node is still loading; ``CLUSTER INFO`` may answer
        ``LOADING`` then)."""
        try:
            self._info(port)
        except (redis.RedisError, OSError):
            return False
        return True

    def _wait(self, check: str, deadline: float) -> None:
        while True:
            if check == "answer" and all(self.answers(p) for p in self.ports):
                return
            if check == "healthy" and self.healthy():
                return
            for port in self.ports:
                if self.pid(port) is None:
                    raise TimeoutError(f"cluster node {port} exited; see {self.log_path(port)}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the cluster is not {check} in time; see the logs in {self.dir / 'logs'}"
                )
            time.sleep(0.2)

    def up(self) -> list[NodeStatus]:
        """Start the nodes that are not running, create the cluster once, and wait until
        every slot is served and every replica is in sync.

        Raises:
            ConfigurationError: a port is taken by a stranger, or redis-server is missing.
            TimeoutError: the cluster did not form in time (see the node logs).
        """
        deadline = time.monotonic() + self.settings.start_timeout_s
        for port in self.ports:
            if self.pid(port) is None:
                self.start_node(port)
        self._wait("answer", deadline)
        if self._info(self.ports[0]).get("cluster_known_nodes") == "1":
            self._create()
        self._wait("healthy", deadline)
        return self.status()

    def _create(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise ConfigurationError("redis-cli is not installed (Debian: redis-tools)")
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        done = subprocess.run(
            [cli, "--cluster", "create", *nodes,
             "--cluster-replicas", str(self.settings.cluster_replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ConfigurationError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}")

    def status(self) -> list[NodeStatus]:
        """One line per node."""
        out = []
        for port in self.ports:
            pid = self.pid(port)
            running = pid is not None and port_open(port)
            role = self.role(port) if running else "-"
            out.append(NodeStatus(port, pid, running, role, self.log_path(port)))
        return out

    def down(self) -> list[int]:
        """Stop the nodes this module started (SIGTERM, then SIGKILL after 20 s)."""
        stopped = []
        for port in self.ports:
            pid = self.pid(port)
            if pid is None:
                continue
            stop_pid(pid, 20)
            self._pidfile(port).unlink(missing_ok=True)
            stopped.append(port)
        for child in self._children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)
        self._children.clear()
        return stopped

    def detach(self) -> None:
        """Leave the nodes this object started running beyond it (as ``dev cluster up``
        does): it forgets them, so dropping it neither waits for them nor warns that
        they still run. They are found again by their pid files."""
        for child in self._children.values():
            if child.poll() is None:
                # Popen's own record that nothing is left to wait for: the node now belongs
                # to the pid file, not to this process.
                child.returncode = 0
        self._children.clear()

    def wipe(self) -> None:
        """Delete every node's data and cluster config (call after :meth:`down`)."""
        shutil.rmtree(self.dir, ignore_errors=True)
