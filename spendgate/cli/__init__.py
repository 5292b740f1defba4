"""The ``spendgate`` command line: thin wiring from commands to the packages.

One module per command group; the tree is put together here, in the order ``--help``
lists it (commands, then groups):

- :mod:`.policy`: ``key-id``, ``policy apply|list|delete``, ``schema export``
- :mod:`.serve`: ``worker``, ``admission``, ``dashboard``
- :mod:`.replay`: ``simulate``, ``replay``
- :mod:`.budgets`: ``budgets``, ``alerts tail``
- :mod:`.demo`: ``demo``
- :mod:`.dev`: ``dev up|env|down|status``, ``dev cluster up|down|status``
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from spendgate._cli_output import say
from spendgate.cli import budgets, demo, dev, policy, replay, serve
from spendgate.cli._options import CONTEXT, WholeHelpGroup
from spendgate.schemas.exceptions import SpendgateError

__all__ = ["app", "main", "say"]

app = typer.Typer(
    cls=WholeHelpGroup,
    help="Rolling-window spend budgets for LLM inference.",
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=CONTEXT,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"spendgate {version('spendgate')}")
        raise typer.Exit


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            expose_value=False,
            callback=_print_version,
            help="Print the installed version and exit.",
        ),
    ] = False,
) -> None:
    """Options before any command."""


app.command("key-id")(policy.key_id)
app.command("worker")(serve.worker)
app.command("admission")(serve.admission)
app.command("dashboard")(serve.dashboard)
app.command("simulate")(replay.simulate)
app.command("budgets")(budgets.budgets)
app.command("replay")(replay.replay)
app.command("demo")(demo.demo)
app.add_typer(dev.dev, name="dev")
app.add_typer(policy.policy, name="policy")
app.add_typer(policy.schema, name="schema")
app.add_typer(budgets.alerts, name="alerts")


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
