"""``spendgate demo``: a short workload through a running admission service and worker."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

TENANTS: dict[str, dict[str, Any]] = {
    "acme": {"model": "claude-sonnet-4", "rate": 3, "tokens": (600, 2500)},
    "globex": {"model": "claude-haiku-4", "rate": 1, "tokens": (200, 900)},
    "initech": {"model": "claude-opus-4", "rate": 1, "tokens": (300, 1200)},
}


@dataclass
class KeyView:
    """What the demo has seen of one budget key."""

    limit: int = 0
    used: int = 0
    reserved: int = 0
    unit: str = ""


@dataclass
class Tally:
    """Running totals shown in the live table."""

    admitted: int = 0
    refused: int = 0
    committed: int = 0
    cancelled: int = 0
    last_retry: dict[str, str] = field(default_factory=dict)
    keys: dict[str, KeyView] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


def _view(tally: Tally, elapsed_s: float) -> Group:
    """The live screen: the budget table, then the latest refusals."""
    return Group(_table(tally, elapsed_s), *(Text.from_markup(line) for line in tally.log[-6:]))


def _table(tally: Tally, elapsed_s: float) -> Table:
    table = Table(
        title=f"spendgate demo - {elapsed_s:4.0f}s  admitted {tally.admitted}  "
        f"refused {tally.refused}  committed {tally.committed}  "
        f"cancelled {tally.cancelled}"
    )
    for col in ("budget key", "unit", "used+reserved / limit", "window", "last Retry-After"):
        table.add_column(col)
    for key, view in sorted(tally.keys.items()):
        share = min(1.0, (view.used + view.reserved) / max(view.limit, 1))
        bar = "#" * int(share * 20) + "." * (20 - int(share * 20))
        table.add_row(
            key,
            view.unit,
            f"[{bar}] {view.used + view.reserved}/{view.limit}",
            "1m",
            tally.last_retry.get(key, "-"),
        )
    return table


async def _one_request(http: httpx.AsyncClient, tenant: str, tally: Tally) -> None:
    spec = TENANTS[tenant]
    estimate = random.randint(*spec["tokens"])
    body = {
        "request_id": uuid.uuid4().hex,
        "subject": {"tenant": tenant, "api_key": f"{tenant}-key-1", "model": spec["model"]},
        "estimate": {
            "requests": 1,
            "input_tokens": estimate // 3,
            "output_tokens": estimate - estimate // 3,
        },
    }
    answer = await http.post("/v1/admit", json=body)
    data = answer.json()
    for b in data.get("budgets", []):
        view = tally.keys.setdefault(b["key"], KeyView())
        view.limit, view.used, view.reserved, view.unit = (
            b["limit"],
            b["used"],
            b["reserved"],
            b["unit"],
        )
    if answer.status_code == 429:
        tally.refused += 1
        wait = "never fits" if data.get("never_fits") else f"{data['retry_after_seconds']}s"
        for b in data["budgets"]:
            if b["policy"] in data["violated"]:
                tally.last_retry[b["key"]] = wait
        tally.log.append(
            f"[red]refused[/] {tenant} {estimate} tokens: {','.join(data['violated'])}"
            f" Retry-After {wait}"
        )
        return
    tally.admitted += 1
    rid = data["reservation_id"]
    await asyncio.sleep(random.uniform(0.2, 1.5))  # the generation streams
    if random.random() < 0.1:
        await http.post("/v1/release", json={"reservation_id": rid})
        tally.cancelled += 1
        return
    share = random.uniform(0.5, 1.0)
    await http.post(
        "/v1/commit",
        json={
            "reservation_id": rid,
            "usage": {
                "requests": 1,
                "input_tokens": estimate // 3,
                "output_tokens": int((estimate - estimate // 3) * share),
            },
        },
    )
    tally.committed += 1


async def _run(base_url: str, seconds: float) -> Tally:
    tally = Tally()
    start = time.monotonic()
    pending: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        with Live(_view(tally, 0), refresh_per_second=4, console=Console()) as live:
            while (elapsed := time.monotonic() - start) < seconds:
                for tenant, spec in TENANTS.items():
                    burst = 4 if tenant == "acme" and int(elapsed) % 10 == 0 else 1
                    if random.random() < spec["rate"] * burst / 10:
                        task = asyncio.create_task(_one_request(http, tenant, tally))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                live.update(_view(tally, elapsed))
                await asyncio.sleep(0.1)
            if pending:
                await asyncio.gather(*pending)
            live.update(_view(tally, time.monotonic() - start))
    return tally


def run_demo(base_url: str = "http://127.0.0.1:8787", seconds: float = 40.0) -> None:
    """Drive admits, commits and cancellations for ``seconds`` and show the windows fill."""
    tally = asyncio.run(_run(base_url, seconds))
    Console().print(
        f"demo done: {tally.admitted} admitted, {tally.refused} refused, "
        f"{tally.committed} committed, {tally.cancelled} cancelled"
    )
