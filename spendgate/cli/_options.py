"""What the command modules share: how a group is made, the common options, logging."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["JsonLogs", "configure_logging", "group"]


def group(summary: str) -> typer.Typer:
    """A command group: no arguments show its help, and help goes through click's plain
    formatter (``rich_markup_mode=None``): it shows boolean options as flags (``--verify /
    --no-verify``), where typer's rich panels print ``<bool>`` beside every flag, and it
    prints messages verbatim (no markup to eat ``[...]``)."""
    return typer.Typer(help=summary, no_args_is_help=True, rich_markup_mode=None)


def configure_logging(json_logs: bool, level: str = "INFO") -> None:
    """One stderr handler on the root logger (an entry point's job, never a module's)."""
    from spendgate.logs import configure

    configure(json_logs=json_logs, level=level)


JsonLogs = Annotated[bool, typer.Option("--json-logs", help="Log one JSON object per line.")]
