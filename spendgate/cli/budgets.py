"""What is near or over its limit now: ``budgets`` (from Redis) and ``alerts tail``."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from spendgate._cli_output import budget_table
from spendgate.cli._options import Output, echo_json, group

if TYPE_CHECKING:
    from spendgate._cli_tables import FitTable
    from spendgate.dashboard.views import KeyRow

__all__ = ["alerts", "budgets"]

alerts = group("Read budget alerts.")


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
    output: Output = "table",
) -> None:
    """The budgets nearest their limits: used/limit, Retry-After now and exhausts_in.

    Read from Redis (the worker's utilization index, then the shown keys' windows; an
    index entry whose window expired is dropped, as the dashboard does). Retry-After is
    when one more unit fits (never: not by ageing alone); exhausts in is the burn-rate
    forecast (README, Forecasts).

    --output json: a list of the keys (policy, key, tenant, unit, limit, used, reserved,
    window_seconds, retry_after_seconds: -1 never, exhausts_in_seconds, share); with
    --watch, one such list per line at every refresh.
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

    def read() -> list[KeyRow]:
        return asyncio.run(
            top_budgets(
                settings.redis(),
                settings.redis_prefix,
                top=top,
                tenant=tenant,
                policy=policy_id,
                subject=pairs,
            )
        )

    def render() -> FitTable:
        return budget_table(read())

    if output == "json":
        echo_json([r.as_json() for r in read()], stream=watch)
        with contextlib.suppress(KeyboardInterrupt):
            while watch:
                time.sleep(interval)
                echo_json([r.as_json() for r in read()], stream=True)
        return
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


@alerts.command("tail")
def alerts_tail(
    from_beginning: Annotated[
        bool, typer.Option("--from-beginning", help="Start at the oldest alert.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Keep waiting for new alerts.")
    ] = True,
    output: Output = "table",
) -> None:
    """Print alerts from the alerts topic, one readable line each.

    --output json: one JSON object per line, each alert as it is on the topic.
    """
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
            if output == "json":
                echo_json(alert.model_dump(mode="json"), stream=True)
            else:
                Console().print(describe(alert), soft_wrap=True, highlight=False, markup=False)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
