"""What the command modules share: how a group is made, the common options, output, logging."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    # typer >= 0.2x carries its own copy of click: its types, not the click package's.
    from typer._click.core import Context
    from typer._click.formatting import HelpFormatter

__all__ = [
    "CONTEXT",
    "JsonLogs",
    "LogLevel",
    "LogLevelName",
    "Output",
    "OutputName",
    "WholeHelpGroup",
    "configure_logging",
    "echo_json",
    "group",
]

#: Every command and group answers ``-h`` as it answers ``--help``.
CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


class WholeHelpGroup(TyperGroup):
    """A group whose command list wraps each command's first sentence instead of cutting it
    at the terminal's width with ``...`` (what click does)."""

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        """The ``Commands:`` section: each command's first sentence, whole, wrapped."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=_WHOLE)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


#: A short help limit no first sentence reaches: it is never cut.
_WHOLE = 10_000


def group(summary: str) -> typer.Typer:
    """A command group: no arguments show its help, and help goes through click's plain
    formatter (``rich_markup_mode=None``): it shows boolean options as flags (``--verify /
    --no-verify``), where typer's rich panels print ``<bool>`` beside every flag, and it
    prints messages verbatim (no markup to eat ``[...]``)."""
    return typer.Typer(
        cls=WholeHelpGroup,
        help=summary,
        no_args_is_help=True,
        rich_markup_mode=None,
        context_settings=CONTEXT,
    )


LogLevelName = Literal["debug", "info", "warning", "error", "critical"]


def configure_logging(json_logs: bool, level: LogLevelName = "info") -> None:
    """One stderr handler on the root logger (an entry point's job, never a module's)."""
    from spendgate.logs import configure

    configure(json_logs=json_logs, level=level.upper())


JsonLogs = Annotated[bool, typer.Option("--json-logs", help="Log one JSON object per line.")]
LogLevel = Annotated[
    LogLevelName,
    typer.Option("--log-level", case_sensitive=False, help="The least severe level logged."),
]

OutputName = Literal["table", "json"]
Output = Annotated[
    OutputName,
    typer.Option(
        "--output",
        "-o",
        case_sensitive=False,
        help="table: for a person (fits the terminal, cuts nothing); json: for a program "
        "(on stdout, nothing else there).",
    ),
]


def echo_json(value: Any, *, stream: bool = False) -> None:
    """Print ``value`` as JSON on stdout: an indented document, or with ``stream`` one line
    (what a command that follows prints per item, for ``jq`` and line readers)."""
    typer.echo(json.dumps(value, indent=None if stream else 2, ensure_ascii=False))
