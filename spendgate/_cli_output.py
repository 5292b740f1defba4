"""What the ``spendgate`` commands print: labelled lines, status and report tables.

Every table is a :class:`~spendgate._cli_tables.FitTable`: nothing is cut at any width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from spendgate._cli_tables import FitTable

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

    from spendgate.dashboard.views import KeyRow
    from spendgate.schemas.policies import Policy
    from spendgate.schemas.status import StackStatus
    from spendgate.simulate_report import Report

console = Console(stderr=True)


def say(label: str, style: str, text: str, *, out: Console | None = None) -> None:
    """Print ``label`` in ``style`` then ``text`` verbatim: never parsed as markup, never cut."""
    (out or console).print(
        Text.assemble((label, style), " ", text), soft_wrap=True, highlight=False
    )


@contextlib.contextmanager
def progress(description: str, out: Console | None = None) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on ``out`` (stderr) while the block runs, drawn only on a terminal
    (a log or a pipe gets no bar frames); yields the ``(done, total)`` callback to report
    to."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    shown = out or console
    if not shown.is_terminal:
        # Not even rich's Progress: it prints an empty line when it stops off a terminal.
        yield lambda done, total: None
        return
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=shown,
    ) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def without_password(url: str) -> str:
    """``url`` with any password replaced by ``***``, fit to print or log."""
    from spendgate.schemas.redis_connect import redact_url

    return redact_url(url)


_STATE_STYLE = {"vouched": "green", "stale": "yellow", "missing": "red"}


@dataclass(frozen=True)
class Decidability:
    """The partition marks under a Redis prefix as admission sees them, or why unread."""

    prefix: str
    status: StackStatus | None
    #: Why Redis could not be read (``status`` is None).
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """``dev status --output json``'s ``decidable`` object."""
        if self.status is None:
            return {"prefix": self.prefix, "error": self.error}
        return {"prefix": self.prefix, **self.status.model_dump(mode="json")}


def read_decidability() -> Decidability:
    """The partition marks of the default settings' Redis prefix, as admission sees them."""
    import redis

    from spendgate.admission.settings import AdmissionSettings
    from spendgate.admission.status import read_status_sync
    from spendgate.schemas import redis_connect

    settings = AdmissionSettings()
    # One node's keys, as the status always read them (a cluster's is admission's
    # /v1/status, which reads its control shard).
    conn = settings.redis().model_copy(update={"cluster": False})
    client = redis_connect.client(conn, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        status = read_status_sync(client, settings.redis_prefix, int(settings.staleness_s * 1000))
    except redis.RedisError as exc:
        error = redis_connect.explain(exc, conn)
        shown = str(error) if error else f"Redis at {conn.redacted()}: {exc}"
        return Decidability(settings.redis_prefix, None, shown)
    finally:
        client.close()
    return Decidability(settings.redis_prefix, status)


def print_decidability(out: Console) -> None:
    """The partition marks of the default settings' Redis prefix, as admission sees them."""
    read = read_decidability()
    status = read.status
    if status is None:
        say("decidable:", "yellow", f"unknown ({read.error})", out=out)
        return
    where = f"prefix {read.prefix!r}, staleness bound {status.staleness_ms} ms"
    if status.decidable:
        say("decidable:", "green", f"yes ({where}, {status.policies} policies)", out=out)
    else:
        say("decidable:", "red", f"no ({where}): {status.reason}", out=out)
    if not status.partitions:
        return
    marks = FitTable("mark", "state", "age ms", "behind", "lag age ms", "owner")
    for p in status.partitions:
        marks.add_row(
            p.field,
            Text(p.state, style=_STATE_STYLE[p.state]),
            "-" if p.age_ms is None else str(p.age_ms),
            "-" if p.lag is None else str(p.lag.records_behind),
            "-" if p.lag is None else str(p.lag.age_ms),
            "-" if p.owner_token is None else str(p.owner_token),
        )
    out.print(marks)


@dataclass(frozen=True)
class Readiness:
    """What the worker's /readyz answered on its metrics port (default settings)."""

    #: None: the metrics port is off (SPENDGATE_METRICS_PORT=0).
    url: str | None
    status_code: int | None = None
    body: Any = None
    #: Why there was no answer (the exception's type).
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """``dev status --output json``'s ``worker`` object."""
        return {
            "url": self.url,
            "ready": None if self.status_code is None else self.status_code == 200,
            "status_code": self.status_code,
            "body": self.body,
            "error": self.error,
        }


def read_worker_readiness() -> Readiness:
    """The worker's /readyz on its metrics port (default settings), when it answers."""
    import httpx

    from spendgate.streams.settings import WorkerSettings

    port = WorkerSettings().metrics_port
    if not port:
        return Readiness(None, error="metrics port off (SPENDGATE_METRICS_PORT=0)")
    url = f"http://127.0.0.1:{port}/readyz"
    try:
        answer = httpx.get(url, timeout=1.0)
        body = answer.json()
    except (httpx.HTTPError, ValueError) as exc:
        return Readiness(url, error=type(exc).__name__)
    return Readiness(url, answer.status_code, body)


def print_worker_readiness(out: Console) -> None:
    """The worker's /readyz on its metrics port (default settings), when it answers."""
    read = read_worker_readiness()
    url, body = read.url, read.body
    if url is None:
        say("worker:", "yellow", "metrics port off (SPENDGATE_METRICS_PORT=0)", out=out)
        return
    if read.status_code is None:
        say("worker:", "yellow", f"no answer at {url} ({read.error})", out=out)
        return
    owned = body.get("partitions", []) if isinstance(body, dict) else []
    detail = ", ".join(f"{p.get('field')} {p.get('state')}" for p in owned) or "no partitions"
    if read.status_code == 200:
        say("worker:", "green", f"ready at {url}: {detail}", out=out)
    else:
        assigned = body.get("assigned") if isinstance(body, dict) else None
        say("worker:", "red", f"not ready at {url} (assigned: {assigned}): {detail}", out=out)


def print_simulation(
    out: Console,
    report: Report,
    draft: Sequence[Policy],
    in_force: Sequence[Policy] | None,
    top: int,
) -> None:
    """Print a simulation's report as tables: with ``in_force`` (the policies read from
    their topic), first those beside the draft; then the per-policy summary, the top keys
    and the totals."""
    if in_force is not None:
        live = {p.id: p for p in in_force}
        table = FitTable("policy", "in force", "draft")
        for p in draft:
            now = live.get(p.id)
            table.add_row(
                Text(p.id),
                Text(f"{now.limit} {now.unit} / {now.window} ({now.on_exceed}, {now.mode})")
                if now is not None
                else Text("(none)"),
                Text(f"{p.limit} {p.unit} / {p.window} ({p.on_exceed}, {p.mode})"),
            )
        out.print(table)
    summary = FitTable(
        "policy", "requests", "refused", "share", "first refusal", "last refusal",
        "units refused", "capped", "peak", "over 80%",
    )  # fmt: skip
    for pr in report.policies.values():
        j = pr.to_json(top)
        summary.add_row(
            Text(pr.policy.id), str(pr.requests), str(pr.refused),
            f"{j['refused_share']:.1%}", str(j["first_refusal"] or "-"),
            str(j["last_refusal"] or "-"), str(pr.refused_units), str(pr.capped),
            f"{j['peak_utilization']:.0%}", f"{j['seconds_over_80pct']:.0f} s",
        )  # fmt: skip
    out.print(summary)
    # The key first: it names its policy (a budget key starts with the policy's id).
    keys = FitTable("top key", "requests", "refused", "first", "last", "peak")
    for pr in report.policies.values():
        for k in pr.top_keys(top):
            keys.add_row(
                Text(k.key), str(k.requests), str(k.refused),
                str(k.to_json()["first_refusal"] or "-"), str(k.to_json()["last_refusal"] or "-"),
                f"{k.peak_utilization:.0%}",
            )  # fmt: skip
    out.print(keys)
    dropped = report.dropped_at_publish
    out.print(
        Text(
            f"{report.usage_records} usage records and {report.refusal_records} refusals "
            f"read in {report.seconds:.1f} s; {report.requests} requests judged "
            f"({report.repeated_refusals} repeated refusals counted once, "
            f"{report.unmatched} matching no draft, {report.unjudged} not judgeable); "
            f"{report.dropped_settlements} settlements of refused requests dropped; "
            + (
                "refusals dropped at publish: none recorded (drops at shutdown: see "
                'spendgate_admission_refusals_total{result="dropped"} on admission)'
                if dropped is None
                else f"refusals dropped at publish: {dropped}"
            )
        )
    )


def policy_table(policies: Iterable[Policy]) -> FitTable:
    """The ``policy list`` command's table."""
    table = FitTable("id", "unit", "limit", "window", "bucket", "match", "group_by", "mode")
    for p in policies:
        # Text cells: a match like {model: [a, b]} is data, not markup.
        cells = (p.id, p.unit, str(p.limit), p.window, p.bucket, str(p.match))
        table.add_row(*(Text(c) for c in (*cells, ",".join(p.group_by), p.mode)))
    return table


def budget_table(rows: Sequence[KeyRow]) -> FitTable:
    """The ``budgets`` command's table of ``rows``."""
    table = FitTable("key", "used / limit", "share", "retry-after", "exhausts in")
    for r in rows:
        exhausts = "-" if r.exhausts_in_seconds is None else f"{r.exhausts_in_seconds} s"
        retry = "never" if r.retry_after_seconds < 0 else f"{r.retry_after_seconds} s"
        table.add_row(
            Text(r.key),
            f"{r.used + r.reserved:,} / {r.limit:,} {r.unit}",
            f"{r.share:.0%}",
            retry,
            exhausts,
        )
    if not rows:
        table.caption = "no budget windows in Redis match"
    return table
