"""The long-running services: ``worker``, ``admission`` and ``dashboard``."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from spendgate.cli._options import JsonLogs, configure_logging

__all__ = ["admission", "dashboard", "worker"]

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


def worker(json_logs: JsonLogs = False) -> None:
    """Run the stream processor: consume usage events, keep windows, materialize to Redis."""
    from spendgate.streams.settings import load_settings
    from spendgate.streams.worker import run_worker

    configure_logging(json_logs)
    run_worker(load_settings())


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
    configure_logging(json_logs)
    serve(AdmissionSettings(**overrides), workers=workers)


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

    configure_logging(json_logs)
    serve(DashboardSettings(**_listen_overrides("dashboard_host", host, allow_unauthenticated)))
