"""The topics' history replayed: ``replay`` rebuilds Redis, ``simulate`` judges drafts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from spendgate._cli_output import console, print_simulation, progress, say
from spendgate.cli._options import Output

__all__ = ["replay", "simulate"]


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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON (as --output json).")
    ] = False,
    chart_file: Annotated[
        Path | None,
        typer.Option("--chart", help="Write a PNG of the top keys' windows to this file."),
    ] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Top keys per policy.")] = 5,
    output: Output = "table",
) -> None:
    """Replay the usage and refusals history against draft policies; nothing is written.

    Every request of the history (admitted reserves and refusals) is judged at its instant
    as admission would judge it under the draft; the report gives, per draft policy and
    key, the requests it would have refused (count, share, first and last time, units),
    peak utilization and the time spent over 80% of the limit.
    """
    from spendgate.simulate import caveats, chart, dumps, run_simulation
    from spendgate.streams.policy_admin import list_policies, load_policies
    from spendgate.streams.settings import WorkerSettings

    draft = load_policies(policies, key_ids=WorkerSettings().key_ids())
    for caveat in caveats(draft):
        say("note", "yellow", caveat)
    since, until = (
        t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t for t in (since, until)
    )
    settings = WorkerSettings()
    with progress("simulating") as done:
        report = run_simulation(settings, draft, since=since, until=until, progress=done)
    if chart_file is not None:
        chart(report, str(chart_file), top=top)
    if as_json or output == "json":
        typer.echo(dumps(report, top))
        return
    in_force = list_policies(settings) if compare else None
    out = Console()
    print_simulation(out, report, draft, in_force, top)
    if chart_file is not None:
        say("chart", "green", str(chart_file), out=out)


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
    from spendgate.streams.replay import run_replay
    from spendgate.streams.settings import WorkerSettings

    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    with progress("replaying usage") as done:
        summary = run_replay(
            WorkerSettings(), since=since, verify=verify, emit_alerts=emit_alerts, progress=done
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
