"""``spendgate dev``: the local Kafka and Redis (``dev cluster``: a local Redis Cluster)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.text import Text

from spendgate._cli_output import (
    console,
    print_decidability,
    print_worker_readiness,
    read_decidability,
    read_worker_readiness,
    say,
)
from spendgate._cli_tables import FitTable
from spendgate.cli._options import Output, echo_json, group

if TYPE_CHECKING:
    from spendgate.devkafka import LocalKafkaCluster

__all__ = ["dev"]

dev = group("Run a local Kafka broker and Redis server (no Docker).")
cluster = group("Run a local Redis Cluster on loopback.")
dev.add_typer(cluster, name="cluster")

Brokers = Annotated[
    int,
    typer.Option(
        "--brokers",
        min=1,
        max=9,
        help="Kafka nodes (KRaft broker+controller each). More than 1, or --security "
        "sasl_ssl, is a second stack on ports from SPENDGATE_KAFKA_CLUSTER_PORT (29092) "
        "in its own folder, beside the default one.",
    ),
]
SecurityName = Literal["plaintext", "sasl_ssl"]  # spendgate.devkafka.Security
Security = Annotated[
    SecurityName,
    typer.Option(
        "--security",
        help="sasl_ssl: clients use SASL_SSL with SCRAM-SHA-512 (a CA, a broker certificate "
        "and a user made in the stack's folder).",
    ),
]


def _kafka_cluster(brokers: int, security: SecurityName) -> LocalKafkaCluster | None:
    """The second stack's Kafka for these flags, or None for the default stack."""
    if brokers == 1 and security == "plaintext":
        return None
    from spendgate.devkafka import KafkaClusterSettings, LocalKafkaCluster

    return LocalKafkaCluster(KafkaClusterSettings(), brokers, security)


@dev.command("up")
def dev_up(brokers: Brokers = 1, security: Security = "plaintext") -> None:
    """Fetch Kafka (once), start Kafka and Redis on loopback, wait until both answer.

    With --brokers 3 and/or --security sasl_ssl: Redis as above, and that Kafka on its own
    ports and folder; prints the SPENDGATE_KAFKA_* lines to export (`dev env` again)."""
    from spendgate.devstack import KAFKA_VERSION, LocalStack, StackSettings

    stack = LocalStack(StackSettings())
    kafka = _kafka_cluster(brokers, security)
    if kafka is not None:
        with console.status(f"starting {brokers} Kafka {KAFKA_VERSION} node(s) and Redis ..."):
            redis = [s for s in stack.up(services=("redis",)) if s.name == "redis"]
            nodes = kafka.up()
            kafka.detach()
        for node in nodes:
            console.print(
                f"[green]up[/] kafka {node.node_id} 127.0.0.1:{node.port} pid {node.pid} "
                f"log {node.log}",
                soft_wrap=True,
            )
        for status in redis:
            console.print(
                f"[green]up[/] redis   127.0.0.1:{status.port} pid {status.pid} log {status.log}",
                soft_wrap=True,
            )
        console.print(f"# connect with ({kafka.dir}):", soft_wrap=True, markup=False)
        console.print("\n".join(kafka.env_lines()), soft_wrap=True, markup=False)
        return
    with console.status(f"starting Kafka {KAFKA_VERSION} and Redis ..."):
        statuses = stack.up()
    for status in statuses:
        console.print(
            f"[green]up[/] {status.name:<5} 127.0.0.1:{status.port} pid {status.pid} "
            f"log {status.log}",
            soft_wrap=True,
        )


@dev.command("env")
def dev_env(brokers: Brokers = 1, security: Security = "plaintext") -> None:
    """Print the SPENDGATE_KAFKA_* lines that point spendgate at the stack `dev up` with the
    same flags starts (the password as a file path, never its value)."""
    kafka = _kafka_cluster(brokers, security)
    if kafka is None:
        from spendgate.devstack import StackSettings

        print(f"export SPENDGATE_KAFKA_BOOTSTRAP=127.0.0.1:{StackSettings().kafka_port}")
        return
    print("\n".join(kafka.env_lines()))


@dev.command("down")
def dev_down(
    wipe: Annotated[
        bool,
        typer.Option("--wipe", help="Also delete the broker's data and Redis's append-only file."),
    ] = False,
    brokers: Brokers = 1,
    security: Security = "plaintext",
) -> None:
    """Stop the Kafka broker and Redis server that `dev up` started (and nothing else).

    With --brokers/--security: stop only that stack's Kafka nodes (--wipe deletes its
    folder: data, certificates, password); Redis stays until a plain `dev down`."""
    from spendgate.devstack import LocalStack, StackSettings

    kafka = _kafka_cluster(brokers, security)
    if kafka is not None:
        nodes = kafka.down()
        console.print(f"stopped: {', '.join(f'kafka {n}' for n in nodes) or 'nothing was running'}")
        if wipe:
            kafka.wipe()
            console.print(f"wiped {kafka.dir}", soft_wrap=True)
        return
    stack = LocalStack(StackSettings())
    stopped = stack.down()
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    if wipe:
        stack.wipe()
        console.print(f"wiped {stack.dir / 'kafka' / 'data'} and {stack.dir / 'redis'}")


@dev.command("status")
def dev_status(
    brokers: Brokers = 1, security: Security = "plaintext", output: Output = "table"
) -> None:
    """Show whether the local Kafka and Redis are running, their pids, ports and logs; then
    whether the stack can decide (every partition mark vouched, read from Redis as
    GET /v1/status reads it) and the worker's readiness (its /readyz on the metrics port).

    With --brokers/--security: that stack's Kafka nodes only. --output json: an object of
    services (or nodes), decidable (GET /v1/status's body and the prefix, or an error) and
    worker (its /readyz: url, ready, status_code, body, or an error)."""
    from spendgate.devstack import KAFKA_VERSION, LocalStack, StackSettings

    kafka = _kafka_cluster(brokers, security)
    if output == "json":
        if kafka is not None:
            nodes = [{**_fields(n), "version": KAFKA_VERSION} for n in kafka.status()]
            echo_json({"nodes": nodes})
            return
        services = [
            {**_fields(s), **({"version": KAFKA_VERSION} if s.name == "kafka" else {})}
            for s in LocalStack(StackSettings()).status()
        ]
        echo_json(
            {
                "services": services,
                "decidable": read_decidability().as_json(),
                "worker": read_worker_readiness().as_json(),
            }
        )
        return
    if kafka is not None:
        nodes_table = FitTable("node", "state", "pid", "port", "log")
        for n in kafka.status():
            nodes_table.add_row(
                Text(f"kafka {KAFKA_VERSION} #{n.node_id}"), _state(n.running),
                str(n.pid or "-"), str(n.port), Text(str(n.log)),
            )  # fmt: skip
        Console().print(nodes_table)
        return
    table = FitTable("service", "state", "pid", "port", "log")
    for s in LocalStack(StackSettings()).status():
        name = f"kafka {KAFKA_VERSION}" if s.name == "kafka" else s.name
        table.add_row(
            Text(name), _state(s.running), str(s.pid or "-"), str(s.port), Text(str(s.log))
        )
    out = Console()
    out.print(table)
    print_decidability(out)
    print_worker_readiness(out)


def _state(running: bool) -> Text:
    return Text("running", style="green") if running else Text("stopped", style="red")


def _fields(status: Any) -> dict[str, Any]:
    """A status dataclass as JSON values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(status).items()}


@cluster.command("up")
def cluster_up() -> None:
    """Start the cluster's nodes (ports from SPENDGATE_CLUSTER_PORT, 7100), create the
    cluster once, and wait until every slot is served and every replica is in sync."""
    from spendgate.devcluster import ClusterSettings, LocalCluster

    nodes = LocalCluster(ClusterSettings())
    with console.status("starting the Redis Cluster ..."):
        statuses = nodes.up()
    for s in statuses:
        console.print(f"[green]up[/] {s.role:<7} 127.0.0.1:{s.port} pid {s.pid} log {s.log}")
    console.print(f"cluster: {nodes.url}", soft_wrap=True)


@cluster.command("down")
def cluster_down(
    wipe: Annotated[
        bool, typer.Option("--wipe", help="Also delete every node's data and cluster config.")
    ] = False,
) -> None:
    """Stop the cluster's nodes that `dev cluster up` started (and nothing else)."""
    from spendgate.devcluster import ClusterSettings, LocalCluster

    nodes = LocalCluster(ClusterSettings())
    stopped = nodes.down()
    console.print(f"stopped: {', '.join(map(str, stopped)) or 'nothing was running'}")
    if wipe:
        nodes.wipe()
        console.print(f"wiped {nodes.dir}")


@cluster.command("status")
def cluster_status(output: Output = "table") -> None:
    """Show each node's pid, port, role and log, and whether the cluster is healthy.

    --output json: an object of nodes and healthy."""
    from spendgate.devcluster import ClusterSettings, LocalCluster

    nodes = LocalCluster(ClusterSettings())
    if output == "json":
        echo_json({"nodes": [_fields(s) for s in nodes.status()], "healthy": nodes.healthy()})
        return
    table = FitTable("node", "state", "role", "pid", "log")
    for s in nodes.status():
        row = (Text(f"127.0.0.1:{s.port}"), _state(s.running), Text(s.role), str(s.pid or "-"))
        table.add_row(*row, Text(str(s.log)))
    out = Console()
    out.print(table)
    healthy = nodes.healthy()
    say("cluster:", "green" if healthy else "red", "healthy" if healthy else "not healthy", out=out)
