"""The ``spendgate`` command line: thin wiring from commands to the packages."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from spendgate._cli_output import (
    budget_table,
    console,
    print_decidability,
    print_simulation,
    print_worker_readiness,
    say,
)
from spendgate.schemas.exceptions import SpendgateError

if TYPE_CHECKING:
    from spendgate.devkafka import LocalKafkaCluster

# Help and usage errors go through click's plain formatter (rich_markup_mode=None): it shows
# boolean options as flags (``--verify / --no-verify``), where typer's rich panels print
# ``<bool>`` beside every flag, and it prints messages verbatim (no markup to eat ``[...]``).
_PLAIN = {"no_args_is_help": True, "rich_markup_mode": None}
app = typer.Typer(
    help="Rolling-window spend budgets for LLM inference.",
    add_completion=False,
    pretty_exceptions_enable=False,
    **_PLAIN,  # type: ignore[arg-type]
)
dev = typer.Typer(help="Run a local Kafka broker and Redis server (no Docker).", **_PLAIN)  # type: ignore[arg-type]
policy = typer.Typer(help="Apply, list and delete budget policies.", **_PLAIN)  # type: ignore[arg-type]
schema = typer.Typer(help="The JSON Schemas of events, policies and API bodies.", **_PLAIN)  # type: ignore[arg-type]
app.add_typer(dev, name="dev")
cluster = typer.Typer(help="Run a local Redis Cluster on loopback.", **_PLAIN)  # type: ignore[arg-type]
dev.add_typer(cluster, name="cluster")
app.add_typer(policy, name="policy")
alerts = typer.Typer(help="Read budget alerts.", **_PLAIN)  # type: ignore[arg-type]
app.add_typer(schema, name="schema")
app.add_typer(alerts, name="alerts")


def _configure_logging(json_logs: bool, level: str = "INFO") -> None:
    from spendgate.logs import configure

    configure(json_logs=json_logs, level=level)


JsonLogs = Annotated[bool, typer.Option("--json-logs", help="Log one JSON object per line.")]


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
def dev_status(brokers: Brokers = 1, security: Security = "plaintext") -> None:
    """Show whether the local Kafka and Redis are running, their pids, ports and logs; then
    whether the stack can decide (every partition mark vouched, read from Redis as
    GET /v1/status reads it) and the worker's readiness (its /readyz on the metrics port).

    With --brokers/--security: that stack's Kafka nodes only."""
    from spendgate.devstack import KAFKA_VERSION, LocalStack, StackSettings

    kafka = _kafka_cluster(brokers, security)
    if kafka is not None:
        nodes_table = Table("node", "state", "pid", "port", "log")
        for n in kafka.status():
            state = "[green]running[/]" if n.running else "[red]stopped[/]"
            nodes_table.add_row(
                f"kafka {KAFKA_VERSION} #{n.node_id}", state, str(n.pid or "-"), str(n.port),
                str(n.log),
            )  # fmt: skip
        Console().print(nodes_table)
        return
    table = Table("service", "state", "pid", "port", "log")
    for s in LocalStack(StackSettings()).status():
        name = f"kafka {KAFKA_VERSION}" if s.name == "kafka" else s.name
        state = "[green]running[/]" if s.running else "[red]stopped[/]"
        table.add_row(name, state, str(s.pid or "-"), str(s.port), str(s.log))
    out = Console()
    out.print(table)
    print_decidability(out)
    print_worker_readiness(out)


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
def cluster_status() -> None:
    """Show each node's pid, port, role and log, and whether the cluster is healthy."""
    from spendgate.devcluster import ClusterSettings, LocalCluster

    nodes = LocalCluster(ClusterSettings())
    table = Table("node", "state", "role", "pid", "log")
    for s in nodes.status():
        state = "[green]running[/]" if s.running else "[red]stopped[/]"
        table.add_row(f"127.0.0.1:{s.port}", state, s.role, str(s.pid or "-"), str(s.log))
    out = Console()
    out.print(table)
    healthy = nodes.healthy()
    say("cluster:", "green" if healthy else "red", "healthy" if healthy else "not healthy", out=out)


ListenHost = Annotated[
    str | None,
    typer.Option("--host", help="Listen address (default: the setting; 127.0.0.1)."),
]
AllowUnauthenticated = Annotated[
    bool,
    typer.Option(
        "--allow-unauthenticated",
        help="Listen beyond loopback without a tokens file (anyone reaching it is trusted).",
    ),
]


def _listen_overrides(host_field: str, host: str | None, allow: bool) -> dict[str, Any]:
    """The settings the listen options override (none given: the environment's)."""
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides[host_field] = host
    if allow:
        overrides["allow_unauthenticated"] = True
    return overrides


@app.command("key-id")
def key_id(
    value: Annotated[str, typer.Argument(help="The raw value (an API key, ...).")],
    field: Annotated[
        str, typer.Option("--field", help="The subject field it is sent in.")
    ] = "api_key",
) -> None:
    """Print the key id a secret subject value is stored as (budget keys, events, alerts).

    Uses the deployment's SPENDGATE_SUBJECT_SECRET_FILE (or SPENDGATE_SUBJECT_SECRET) and
    SPENDGATE_SECRET_FIELDS, as every service does. Pass the value as an argument only
    where your shell history is safe; '-' reads it from stdin.
    """
    from spendgate.streams.settings import WorkerSettings

    keys = WorkerSettings().key_ids()
    if not keys.secret_field(field):
        raise typer.BadParameter(
            f"{field!r} is not a secret field (SPENDGATE_SECRET_FIELDS: "
            f"{','.join(keys.fields) or 'none'}): it is stored as sent",
            param_hint="--field",
        )
    raw = sys.stdin.readline().rstrip("\r\n") if value == "-" else value
    if keys.built_in:
        note = "no SPENDGATE_SUBJECT_SECRET(_FILE): the public built-in secret"
        say("note", "yellow", note, out=Console(stderr=True))
    typer.echo(keys.of(raw, field))


@app.command("worker")
def worker(json_logs: JsonLogs = False) -> None:
    """Run the stream processor: consume usage events, keep windows, materialize to Redis."""
    from spendgate.streams.settings import load_settings
    from spendgate.streams.worker import run_worker

    _configure_logging(json_logs)
    run_worker(load_settings())


@app.command("admission")
def admission(
    json_logs: JsonLogs = False,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Processes serving the one port; each decides through the same atomic script.",
        ),
    ] = 1,
    host: ListenHost = None,
    allow_unauthenticated: AllowUnauthenticated = False,
) -> None:
    """Run the admission HTTP service (POST /v1/admit ...).

    Without SPENDGATE_AUTH_TOKENS_FILE it listens only on a loopback address, unless
    --allow-unauthenticated says so explicitly.
    """
    from spendgate.admission.server import serve
    from spendgate.admission.settings import AdmissionSettings

    overrides = _listen_overrides("admission_host", host, allow_unauthenticated)
    if workers > 1:
        # Each process reads its settings from the environment (admission.server).
        for name, v in overrides.items():
            os.environ[f"SPENDGATE_{name.upper()}"] = "true" if v is True else str(v)
    _configure_logging(json_logs)
    serve(AdmissionSettings(**overrides), workers=workers)


@app.command("dashboard")
def dashboard(
    json_logs: JsonLogs = False,
    host: ListenHost = None,
    allow_unauthenticated: AllowUnauthenticated = False,
) -> None:
    """Serve the read-only operator dashboard (default http://127.0.0.1:8788/).

    Budgets nearest their limits, a key's window over time, refusals, decisions, worker
    lag, dead letters and the latest alerts, live. Sign in with a token of
    SPENDGATE_AUTH_TOKENS_FILE ('operator' sees every tenant).
    """
    from spendgate.dashboard.server import serve
    from spendgate.dashboard.settings import DashboardSettings

    _configure_logging(json_logs)
    serve(DashboardSettings(**_listen_overrides("dashboard_host", host, allow_unauthenticated)))


@policy.command("apply")
def policy_apply(
    file: Annotated[
        Path,
        typer.Argument(
            help="A YAML or JSON file: one policy or a list.", exists=True, dir_okay=False
        ),
    ],
) -> None:
    """Validate policies from FILE and publish them; a bad file changes nothing.

    Waits for Kafka at most SPENDGATE_POLICY_TIMEOUT_S (30 s) in all, then exits 3.
    """
    from spendgate.streams.policy_admin import apply_file, policy_settings

    settings = policy_settings()
    for applied in apply_file(settings, file, timeout_s=settings.policy_timeout_s):
        say("applied", "green", applied)


@policy.command("list")
def policy_list() -> None:
    """List the policies in force (waiting for Kafka at most SPENDGATE_POLICY_TIMEOUT_S)."""
    from spendgate.streams.policy_admin import list_policies, policy_settings

    settings = policy_settings()
    table = Table("id", "unit", "limit", "window", "bucket", "match", "group_by", "mode")
    for p in list_policies(settings, timeout_s=settings.policy_timeout_s):
        # Text cells: a match like {model: [a, b]} is data, not markup.
        cells = (p.id, p.unit, str(p.limit), p.window, p.bucket, str(p.match))
        table.add_row(*(Text(c) for c in (*cells, ",".join(p.group_by), p.mode)))
    Console().print(table)


@policy.command("delete")
def policy_delete(policy_id: Annotated[str, typer.Argument(help="The policy id.")]) -> None:
    """Delete a policy (a tombstone on the policies topic).

    Waits for Kafka at most SPENDGATE_POLICY_TIMEOUT_S (30 s) in all, then exits 3.
    """
    from spendgate.streams.policy_admin import delete_policy, policy_settings

    settings = policy_settings()
    delete_policy(settings, policy_id, timeout_s=settings.policy_timeout_s)
    say("deleted", "", policy_id)


@app.command("simulate")
def simulate(
    policies: Annotated[
        Path, typer.Option("--policies", help="The draft policies (YAML or JSON).")
    ],
    since: Annotated[
        datetime | None,
        typer.Option("--from", help="Start at this time (ISO 8601; default: the beginning)."),
    ] = None,
    until: Annotated[
        datetime | None,
        typer.Option("--to", help="Leave out what happened after this time (ISO 8601)."),
    ] = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Print the policies in force beside the draft.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    chart_file: Annotated[
        Path | None,
        typer.Option("--chart", help="Write a PNG of the top keys' windows to this file."),
    ] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Top keys per policy.")] = 5,
) -> None:
    """Replay the usage and refusals history against draft policies; nothing is written.

    Every request of the history (admitted reserves and refusals) is judged at its instant
    as admission would judge it under the draft; the report gives, per draft policy and
    key, the requests it would have refused (count, share, first and last time, units),
    peak utilization and the time spent over 80% of the limit.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from spendgate.simulate import caveats, chart, dumps, run_simulation
    from spendgate.streams.policy_admin import load_policies
    from spendgate.streams.settings import WorkerSettings

    draft = load_policies(policies, key_ids=WorkerSettings().key_ids())
    for caveat in caveats(draft):
        say("note", "yellow", caveat)
    since, until = (
        t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t for t in (since, until)
    )
    settings = WorkerSettings()
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task("simulating", total=None)
        report = run_simulation(
            settings,
            draft,
            since=since,
            until=until,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if chart_file is not None:
        chart(report, str(chart_file), top=top)
    if as_json:
        typer.echo(dumps(report, top))
        return
    out = Console()
    print_simulation(out, report, draft, settings if compare else None, top)
    if chart_file is not None:
        say("chart", "green", str(chart_file), out=out)


@app.command("budgets")
def budgets(
    top: Annotated[int, typer.Option("--top", "-n", min=1, help="How many budgets.")] = 20,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's.")] = None,
    policy_id: Annotated[str | None, typer.Option("--policy", help="Only this policy's.")] = None,
    subject: Annotated[
        list[str] | None,
        typer.Option(
            "--subject", help="FIELD=VALUE a key must group by (repeatable, e.g. api_key=k1)."
        ),
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh in place every --interval seconds.")
    ] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Refresh period.")] = 2.0,
) -> None:
    """The budgets nearest their limits: used/limit, Retry-After now and exhausts_in.

    Read from Redis (the worker's utilization index, then the shown keys' windows; an
    index entry whose window expired is dropped, as the dashboard does). Retry-After is
    when one more unit fits (never: not by ageing alone); exhausts in is the burn-rate
    forecast (README, Forecasts).
    """
    import asyncio
    import time

    from rich.live import Live

    from spendgate.budgets import top_budgets
    from spendgate.streams.settings import WorkerSettings

    pairs = []
    for item in subject or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise typer.BadParameter(f"{item!r} is not FIELD=VALUE", param_hint="--subject")
        pairs.append((name, value))
    settings = WorkerSettings()
    # Keys carry key ids of secret fields: a raw value given here is looked up as its id.
    pairs = settings.key_ids().query(pairs)

    def render() -> Table:
        rows = asyncio.run(
            top_budgets(
                settings.redis(),
                settings.redis_prefix,
                top=top,
                tenant=tenant,
                policy=policy_id,
                subject=pairs,
            )
        )
        return budget_table(rows)

    out = Console()
    if not watch:
        out.print(render())
        return
    with (
        Live(render(), console=out, auto_refresh=False) as live,
        contextlib.suppress(KeyboardInterrupt),
    ):
        while True:
            time.sleep(interval)
            live.update(render(), refresh=True)


@app.command("replay")
def replay(
    since: Annotated[
        datetime | None,
        typer.Option("--from", help="Start at this time (ISO 8601) instead of the beginning."),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option("--verify/--no-verify", help="Compare with Redis; exit 1 on any difference."),
    ] = False,
    emit_alerts: Annotated[
        bool,
        typer.Option(
            "--emit-alerts/--no-emit-alerts", help="Publish the rebuilt alerts (same ids)."
        ),
    ] = False,
) -> None:
    """Rebuild every budget window from the usage topic and restore it into Redis.

    Stop the workers first; with --verify nothing is written. The worker's own RocksDB
    tables rebuild themselves from their changelog topic when their folder is wiped.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from spendgate.streams.replay import run_replay
    from spendgate.streams.settings import WorkerSettings

    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("replaying usage", total=None)
        summary = run_replay(
            WorkerSettings(),
            since=since,
            verify=verify,
            emit_alerts=emit_alerts,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(summary.outcomes.items())) or "none"
    console.print(
        f"read {summary.records} records ({summary.dead_lettered} dead-letter reasons, "
        f"{summary.clamped} clamped, {summary.duplicates} duplicates); keyed records: "
        f"{outcomes}; {summary.keys} budget keys; "
        f"{len(summary.alerts)} alerts" + ("" if verify else "; Redis restored")
    )
    if verify:
        if summary.differences:
            for key in summary.differences[:20]:
                say("differs", "red", key)
            console.print(f"[red]{len(summary.differences)} budget keys differ[/]")
            raise typer.Exit(1)
        console.print("[green]verified:[/] Redis equals the rebuilt windows")


@alerts.command("tail")
def alerts_tail(
    from_beginning: Annotated[
        bool, typer.Option("--from-beginning", help="Start at the oldest alert.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Keep waiting for new alerts.")
    ] = True,
) -> None:
    """Print alerts from the alerts topic, one readable line each."""
    import asyncio

    from spendgate.streams.alert_feed import describe, read_alerts
    from spendgate.streams.settings import WorkerSettings

    settings = WorkerSettings()

    async def run() -> None:
        async for alert in read_alerts(
            settings.kafka(),
            settings.topic("alerts"),
            from_beginning=from_beginning,
            follow=follow,
        ):
            Console().print(describe(alert), soft_wrap=True, highlight=False, markup=False)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


@schema.command("export")
def schema_export(
    directory: Annotated[
        Path, typer.Argument(help="Where to write the *.schema.json files.", file_okay=False)
    ] = Path("schemas/json"),
) -> None:
    """Write the JSON Schema files of the models (checked in under schemas/json)."""
    from spendgate.schemas.jsonschema import export

    for path in export(directory):
        console.print(f"wrote {path}")


@app.command("demo")
def demo(
    seconds: Annotated[
        float,
        typer.Option(
            min=35,
            help="How long the workload runs (35 s at least: the delay step needs a 30 s "
            "window to fill and roll).",
        ),
    ] = 40.0,
    url: Annotated[str, typer.Option(help="The admission service.")] = "http://127.0.0.1:8787",
    chart: Annotated[
        Path, typer.Option(help="Where to write the PNG chart of usage against limit.")
    ] = Path("demo-out/demo-usage.png"),
    wait: Annotated[
        float,
        typer.Option(
            min=0,
            help="First wait up to this many seconds for the stack to decide (GET /v1/status: "
            "policies loaded, every partition mark vouched); 0: start at once.",
        ),
    ] = 60.0,
) -> None:
    """Run a short demo workload against a running worker and admission service.

    Exits 1 when the run did not show every showcased behaviour (a refusal with
    Retry-After, burst, route, a stream stopped by a refused extend, overage, delay,
    alerts): the demo doubles as the main job's end-to-end check.
    """
    from spendgate.demo import run_demo

    tally = run_demo(base_url=url, seconds=seconds, chart=chart, wait_s=wait)
    if missing := tally.missing():
        say("demo failed:", "red", "not shown this run: " + "; ".join(missing))
        raise typer.Exit(1)


def main() -> None:
    """Entry point of the ``spendgate`` console script."""
    try:
        app()
    except SpendgateError as exc:
        say("error:", "red", str(exc))
        sys.exit(2)
    except TimeoutError as exc:
        say("error:", "red", str(exc))
        sys.exit(3)
    logging.shutdown()
