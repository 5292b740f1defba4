"""The long-running services: ``worker``, ``admission`` and ``dashboard``."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from spendgate.cli._options import JsonLogs, LogLevel, configure_logging

__all__ = ["admission", "dashboard", "worker"]

ListenHost = Annotated[
    str | None,
    typer.Option("--host", help="Listen address (default: the setting; 127.0.0.1)."),
]


def _port(raw: str) -> int:
    """A listen port, or a usage error that says what one is."""
    if raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 65535:
        return int(raw)
    raise typer.BadParameter(f"{raw!r} is not a port: an integer from 1 to 65535")


AdmissionPort = Annotated[
    int | None,
    typer.Option(
        "--port",
        parser=_port,
        metavar="PORT",
        help="Listen port, 1 to 65535 (default: SPENDGATE_ADMISSION_PORT; 8787).",
    ),
]
DashboardPort = Annotated[
    int | None,
    typer.Option(
        "--port",
        parser=_port,
        metavar="PORT",
        help="Listen port, 1 to 65535 (default: SPENDGATE_DASHBOARD_PORT; 8788).",
    ),
]
AllowUnauthenticated = Annotated[
    bool,
    typer.Option(
        "--allow-unauthenticated",
        help="Listen beyond loopback without a tokens file (anyone reaching it is trusted).",
    ),
]


def _listen_overrides(
    service: str, host: str | None, port: int | None, allow: bool
) -> dict[str, Any]:
    """The settings the listen options override (none given: the environment's): the
    fields ``<service>_host`` and ``<service>_port`` that SPENDGATE_<SERVICE>_HOST and
    _PORT set."""
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides[f"{service}_host"] = host
    if port is not None:
        overrides[f"{service}_port"] = port
    if allow:
        overrides["allow_unauthenticated"] = True
    return overrides


def worker(json_logs: JsonLogs = False, log_level: LogLevel = "info") -> None:
    """Run the stream processor: consume usage events, keep windows, materialize to Redis."""
    from spendgate.streams.settings import load_settings
    from spendgate.streams.worker import run_worker

    configure_logging(json_logs, log_level)
    run_worker(load_settings())


def admission(
    json_logs: JsonLogs = False,
    log_level: LogLevel = "info",
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Processes serving the one port; each decides through the same atomic script.",
        ),
    ] = 1,
    host: ListenHost = None,
    port: AdmissionPort = None,
    allow_unauthenticated: AllowUnauthenticated = False,
) -> None:
    """Run the admission HTTP service (POST /v1/admit ...).

    Without SPENDGATE_AUTH_TOKENS_FILE it listens only on a loopback address, unless
    --allow-unauthenticated says so explicitly.
    """
    from spendgate.admission.server import serve
    from spendgate.admission.settings import AdmissionSettings

    overrides = _listen_overrides("admission", host, port, allow_unauthenticated)
    if workers > 1:
        # Each process reads its settings from the environment (admission.server).
        for name, v in overrides.items():
            os.environ[f"SPENDGATE_{name.upper()}"] = "true" if v is True else str(v)
    configure_logging(json_logs, log_level)
    serve(AdmissionSettings(**overrides), workers=workers)


def dashboard(
    json_logs: JsonLogs = False,
    log_level: LogLevel = "info",
    host: ListenHost = None,
    port: DashboardPort = None,
    allow_unauthenticated: AllowUnauthenticated = False,
) -> None:
    """Serve the read-only operator dashboard (default http://127.0.0.1:8788/).

    Budgets nearest their limits, a key's window over time, refusals, decisions, worker
    lag, dead letters and the latest alerts, live. Sign in with a token of
    SPENDGATE_AUTH_TOKENS_FILE ('operator' sees every tenant).
    """
    from spendgate.dashboard.server import serve
    from spendgate.dashboard.settings import DashboardSettings

    configure_logging(json_logs, log_level)
    serve(DashboardSettings(**_listen_overrides("dashboard", host, port, allow_unauthenticated)))
