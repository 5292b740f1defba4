"""``spendgate demo``: the demo workload against a running stack, and its verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spendgate._cli_output import say

__all__ = ["demo"]


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
