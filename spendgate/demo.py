"""``spendgate demo``: a short workload through a running admission service and worker.

Several tenants and models; bursts; generations that stream (and report usage as they
go); cancellations mid-stream (partial usage is committed, nothing generated is released);
late usage reports (commits and refunds with an ``occurred_at`` in the past, published
straight to Kafka as an inference worker reporting after the fact would); and the
enforcement actions once each on tenant ``hooli`` (``examples/demo-policies.yaml``): a
burst cut by a token bucket, a request held by ``delay`` until it fits, one ``route``d to
another pool, a stream stopped by a refused extend, and an overage. A live table
shows every budget key; at the end a PNG chart shows usage against limit over time per
budget key, with refusals marked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

logger = logging.getLogger(__name__)

#: tenant -> models it calls, api keys, mean requests per second, token range per request.
TENANTS: dict[str, dict[str, Any]] = {
    "acme": {
        "models": ["claude-sonnet-4", "claude-haiku-4"],
        "keys": ["acme-key-1"],
        "rate": 3.0,
        "tokens": (600, 2500),
    },
    "globex": {
        "models": ["claude-haiku-4"],
        "keys": ["globex-key-1"],
        "rate": 1.0,
        "tokens": (200, 900),
    },
    "initech": {
        "models": ["claude-opus-4"],
        "keys": ["initech-key-1", "initech-key-2"],
        "rate": 1.2,
        "tokens": (300, 1200),
    },
    "umbrella": {
        "models": ["claude-opus-4", "claude-sonnet-4"],
        "keys": ["umbrella-key-1"],
        "rate": 0.8,
        "tokens": (400, 1800),
    },
}
DEFAULT_CHART = Path("demo-out/demo-usage.png")


@dataclass
class KeyView:
    """What the demo has seen of one budget key."""

    limit: int = 0
    used: int = 0
    reserved: int = 0
    unit: str = ""
    window_s: int = 0
    #: (seconds since start, used + reserved) samples for the chart.
    points: list[tuple[float, int]] = field(default_factory=list)
    #: seconds since start of each refusal on this key.
    refusals: list[float] = field(default_factory=list)


@dataclass
class Tally:
    """Running totals shown in the live table."""

    admitted: int = 0
    refused: int = 0
    committed: int = 0
    cancelled: int = 0
    late_reports: int = 0
    errors: int = 0
    last_retry: dict[str, str] = field(default_factory=dict)
    keys: dict[str, KeyView] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    #: (seconds since start, text) of late reports, marked on the chart.
    late: list[tuple[float, str]] = field(default_factory=list)
    #: What the enforcement-action showcase saw (printed again at the end).
    actions: list[str] = field(default_factory=list)


def _view(tally: Tally, elapsed_s: float) -> Group:
    """The live screen: the budget table, then the latest events."""
    return Group(_table(tally, elapsed_s), *(Text.from_markup(line) for line in tally.log[-6:]))


def _table(tally: Tally, elapsed_s: float) -> Table:
    table = Table(
        title=f"spendgate demo - {elapsed_s:4.0f}s  admitted {tally.admitted}  "
        f"refused {tally.refused}  committed {tally.committed}  "
        f"cancelled {tally.cancelled}  late reports {tally.late_reports}"
    )
    # The key column folds (wraps mid-word) rather than cutting: a key has no spaces, and
    # which tenant is near its limit is the point of the table. Cells are Text, never markup.
    table.add_column("budget key", overflow="fold", ratio=3)
    for col in ("unit", "used+reserved / limit", "window", "last Retry-After"):
        table.add_column(col, overflow="fold")
    for key, view in sorted(tally.keys.items()):
        share = min(1.0, (view.used + view.reserved) / max(view.limit, 1))
        bar = "#" * int(share * 20) + "." * (20 - int(share * 20))
        table.add_row(
            Text(key),
            Text(view.unit),
            Text(f"[{bar}] {view.used + view.reserved}/{view.limit}"),
            f"{view.window_s}s" if view.window_s else "-",
            Text(tally.last_retry.get(key, "-")),
        )
    return table


def _observe(tally: Tally, budgets: list[dict[str, Any]], at: float) -> None:
    for b in budgets:
        view = tally.keys.setdefault(b["key"], KeyView())
        view.limit, view.used, view.reserved, view.unit = (
            b["limit"],
            b["used"],
            b["reserved"],
            b["unit"],
        )
        view.window_s = int(b.get("window_seconds", 0))
        view.points.append((at, b["used"] + b["reserved"]))


class _Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start


async def _one_request(
    http: httpx.AsyncClient, tenant: str, tally: Tally, clock: _Clock, rng: random.Random
) -> None:
    spec = TENANTS[tenant]
    model = rng.choice(spec["models"])
    api_key = rng.choice(spec["keys"])
    estimate = rng.randint(*spec["tokens"])
    inp = estimate // 3
    out_est = estimate - inp
    body = {
        "request_id": uuid.uuid4().hex,
        "subject": {"tenant": tenant, "api_key": api_key, "model": model},
        "estimate": {"requests": 1, "input_tokens": inp, "output_tokens": out_est},
    }
    answer = await http.post("/v1/admit", json=body)
    data = answer.json()
    _observe(tally, data.get("budgets", []), clock.now())
    if answer.status_code == 429:
        tally.refused += 1
        wait = "never fits" if data.get("never_fits") else f"{data['retry_after_seconds']}s"
        for b in data["budgets"]:
            if b["policy"] in data["violated"]:
                tally.last_retry[b["key"]] = wait
                tally.keys[b["key"]].refusals.append(clock.now())
        tally.log.append(
            f"[red]refused[/] {tenant}/{model} {estimate} tokens: {','.join(data['violated'])}"
            f" Retry-After {wait}"
        )
        return
    if answer.status_code != 200:
        tally.errors += 1
        tally.log.append(f"[yellow]admit answered {answer.status_code}[/]")
        return
    tally.admitted += 1
    rid = data["reservation_id"]
    cap = data.get("max_output_tokens") or out_est
    # The generation streams in chunks; some callers hang up mid-stream.
    chunks = rng.randint(2, 6)
    cancel_at = rng.randint(0, chunks - 1) if rng.random() < 0.15 else None
    generated = 0
    for n in range(chunks):
        if cancel_at is not None and n == cancel_at:
            break
        await asyncio.sleep(rng.uniform(0.1, 0.4))
        generated += int(cap * rng.uniform(0.5, 1.0) / chunks)
    if cancel_at is not None:
        tally.cancelled += 1
        if generated == 0:
            await http.post("/v1/release", json={"reservation_id": rid})
            tally.log.append(f"[yellow]cancelled[/] {tenant}/{model} before any output: released")
            return
        tally.log.append(
            f"[yellow]cancelled[/] {tenant}/{model} mid-stream: commits {generated} output tokens"
        )
    await http.post(
        "/v1/commit",
        json={
            "reservation_id": rid,
            "usage": {"requests": 1, "input_tokens": inp, "output_tokens": generated},
        },
    )
    tally.committed += 1


async def _late_reports(tally: Tally, clock: _Clock, seconds: float, rng: random.Random) -> None:
    """Every few seconds an inference worker reports usage late, straight to Kafka."""
    from aiokafka import AIOKafkaProducer

    bootstrap = os.environ.get("SPENDGATE_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    topic = os.environ.get("SPENDGATE_TOPIC_PREFIX", "budget.") + "usage"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    try:
        await asyncio.wait_for(producer.start(), timeout=10)
    except Exception as exc:  # noqa: BLE001 - the demo goes on without late reports
        tally.log.append(f"[yellow]no late reports: Kafka at {bootstrap}: {exc}[/]")
        with contextlib.suppress(Exception):
            await producer.stop()
        return
    try:
        while clock.now() < seconds - 2:
            await asyncio.sleep(rng.uniform(3.0, 6.0))
            tenant = rng.choice(list(TENANTS))
            model = rng.choice(TENANTS[tenant]["models"])
            age_s = rng.randint(10, 40)
            occurred = datetime.fromtimestamp(time.time() - age_s, UTC).isoformat()
            if rng.random() < 0.7:
                tokens = rng.randint(500, 3000)
                event: dict[str, Any] = {
                    "kind": "commit",
                    "usage": {
                        "requests": 1,
                        "input_tokens": tokens // 3,
                        "output_tokens": tokens - tokens // 3,
                    },
                }
                what = f"{tokens} tokens used {age_s}s ago"
            else:
                refund = rng.randint(100, 800)
                event = {"kind": "adjust", "usage": {"output_tokens": -refund}}
                what = f"refund of {refund} tokens for {age_s}s ago"
            event.update(
                schema_version=1,
                event_id=uuid.uuid4().hex,
                subject={
                    "tenant": tenant,
                    "api_key": rng.choice(TENANTS[tenant]["keys"]),
                    "model": model,
                },
                occurred_at=occurred,
            )
            await producer.send_and_wait(topic, json.dumps(event).encode(), key=tenant.encode())
            tally.late_reports += 1
            tally.late.append((clock.now(), f"{tenant}: {what}"))
            tally.log.append(f"[cyan]late report[/] {tenant}/{model}: {what}")
    finally:
        await producer.stop()


async def _showcase(http: httpx.AsyncClient, tally: Tally, clock: _Clock, seconds: float) -> None:
    """burst, delay and route once each, on tenant hooli (skipped without its policies)."""

    async def admit(model: str, **subject: str) -> httpx.Response:
        answer = await http.post(
            "/v1/admit",
            json={
                "request_id": uuid.uuid4().hex,
                "subject": {"tenant": "hooli", "api_key": "hooli-key-1", "model": model, **subject},
                "estimate": {"requests": 1, "input_tokens": 50, "output_tokens": 50},
            },
        )
        _observe(tally, answer.json().get("budgets", []), clock.now())
        if answer.status_code == 200:
            tally.admitted += 1
            with contextlib.suppress(httpx.HTTPError):
                await http.post(
                    "/v1/commit",
                    json={
                        "reservation_id": answer.json()["reservation_id"],
                        "usage": {"requests": 1, "input_tokens": 50, "output_tokens": 40},
                    },
                )
                tally.committed += 1
        elif answer.status_code == 429:
            tally.refused += 1
        return answer

    def say(line: str) -> None:
        tally.actions.append(line)
        tally.log.append(f"[magenta]{escape(line)}[/]")

    # burst: 6 at once against a bucket of 3.
    await asyncio.sleep(2)
    burst = await asyncio.gather(*(admit("claude-sonnet-4") for _ in range(6)))
    refused = [a for a in burst if a.status_code == 429]
    say(
        f"burst: 6 sonnet requests at once, {6 - len(refused)} admitted, {len(refused)} refused "
        f"by the token bucket (Retry-After {refused[0].headers.get('Retry-After', '-')}s)"
        if refused
        else "burst: no token bucket refused (policy hooli-sonnet-burst not applied?)"
    )
    # route: the third request on gpu-east goes to gpu-west.
    for _ in range(3):
        routed = await admit("claude-opus-4", pool="gpu-east")
    body = routed.json()
    say(
        f"route: third request on gpu-east answered {body.get('decision')}"
        f" -> {body.get('route_to')}"
    )
    await _stream_and_overage(http, say)
    # delay: 2 haiku now fill the 30 s window; one more ~22 s later is held until it fits.
    await asyncio.gather(admit("claude-haiku-4"), admit("claude-haiku-4"))
    wait = max(0.0, min(seconds - 12, clock.now() + 22) - clock.now())
    await asyncio.sleep(wait)
    say("delay: a third haiku request arrives; the window is full, it will be held...")
    held = (await admit("claude-haiku-4")).json()
    say(
        f"delay: answered {held.get('decision')} after {held.get('delayed_ms', 0)} ms"
        + (f" ({held['reason']})" if held.get("reason") else "")
    )


async def _stream_and_overage(http: httpx.AsyncClient, say: Callable[[str], None]) -> None:
    """A stream stopped by a refused extend, then an overage (policy hooli-stream-output)."""

    def subject(key: str) -> dict[str, str]:
        return {"tenant": "hooli", "api_key": key, "model": "claude-opus-4"}

    async def admit(key: str, output_tokens: int) -> httpx.Response:
        return await http.post(
            "/v1/admit",
            json={
                "request_id": uuid.uuid4().hex,
                "subject": subject(key),
                "estimate": {"requests": 1, "output_tokens": output_tokens},
            },
        )

    async def commit(rid: str, output_tokens: int) -> None:
        usage = {"requests": 1, "output_tokens": output_tokens}
        await http.post("/v1/commit", json={"reservation_id": rid, "usage": usage})

    # Reserve 300 output tokens, then 300 more before each chunk would pass the reservation.
    first = await admit("hooli-stream-a", 300)
    if first.status_code != 200:
        say("stream: not admitted (policy hooli-stream-output not applied?)")
        return
    rid, reserved, used, seq = first.json()["reservation_id"], 300, 0, 0
    refusal: dict[str, Any] = {}
    while used < 10_000:
        if used + 100 > reserved:
            seq += 1
            body = {"reservation_id": rid, "seq": seq, "add": {"output_tokens": 300}}
            grown = await http.post("/v1/extend", json=body)
            if grown.status_code != 200:
                refusal = grown.json()
                break
            reserved += 300
        used += 100  # one chunk generated
    await commit(rid, used)
    violated = refusal.get("violated", [])
    left = {
        b["policy"]: b["remaining"] for b in refusal.get("budgets", []) if b["policy"] in violated
    }
    say(
        f"stream: {seq - 1} extends granted, stopped at {used} output tokens when extend {seq} "
        f"was refused (remaining {left}); committed {used}"
    )
    # Overage: estimated 200, used 500.
    over = await admit("hooli-stream-b", 200)
    if over.status_code == 200:
        await commit(over.json()["reservation_id"], 500)
        await asyncio.sleep(3)  # the worker records the overage
        again = await admit("hooli-stream-b", 200)
        budgets = again.json().get("budgets", [])
        held = next((b["reserved"] for b in budgets if b["policy"] == "hooli-stream-output"), "?")
        if again.status_code == 200:
            await commit(again.json()["reservation_id"], 200)
        say(
            "overage: estimated 200, committed 500: charged in full, an overage alert "
            f"(spendgate alerts tail); cap_next holds the next 200 estimate at {held}"
        )


async def _poll_budgets(
    http: httpx.AsyncClient, tally: Tally, clock: _Clock, seconds: float
) -> None:
    """Sample every subject's budgets once a second (the chart's regular points)."""
    subjects = [
        {"tenant": t, "api_key": key, "model": m}
        for t, spec in TENANTS.items()
        for key in spec["keys"]
        for m in spec["models"]
    ]
    while clock.now() < seconds:
        for subject in subjects:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                answer = await http.get("/v1/budgets", params=subject)
                if answer.status_code == 200:
                    _observe(tally, answer.json().get("budgets", []), clock.now())
        await asyncio.sleep(1.0)


async def _run(base_url: str, seconds: float, seed: int | None, late: bool) -> Tally:
    tally = Tally()
    rng = random.Random(seed)
    clock = _Clock()
    pending: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        side = [
            asyncio.create_task(_poll_budgets(http, tally, clock, seconds)),
            asyncio.create_task(_showcase(http, tally, clock, seconds)),
        ]
        if late:
            side.append(asyncio.create_task(_late_reports(tally, clock, seconds, rng)))
        with Live(_view(tally, 0), refresh_per_second=4, console=Console()) as live:
            while (elapsed := clock.now()) < seconds:
                for tenant, spec in TENANTS.items():
                    # acme bursts 4x for one second in every ten; globex once in 15 s.
                    burst = 4 if tenant == "acme" and int(elapsed) % 10 == 0 else 1
                    burst = 6 if tenant == "globex" and int(elapsed) % 15 == 7 else burst
                    if rng.random() < spec["rate"] * burst / 10:
                        task = asyncio.create_task(_one_request(http, tenant, tally, clock, rng))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                live.update(_view(tally, elapsed))
                await asyncio.sleep(0.1)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            live.update(_view(tally, clock.now()))
    return tally


def write_chart(tally: Tally, path: Path) -> Path:
    """A PNG: one panel per budget key, used+reserved against its limit, refusals marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(k for k, v in tally.keys.items() if v.points)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = 2 if len(keys) > 1 else 1
    rows = max(1, (len(keys) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys, strict=False):
        view = tally.keys[key]
        xs, ys = zip(*sorted(view.points), strict=True)
        ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.3, label="used + reserved")
        ax.axhline(view.limit, color="black", linestyle="--", linewidth=1, label="limit")
        if view.refusals:
            ax.plot(
                view.refusals,
                [view.limit] * len(view.refusals),
                "x",
                color="red",
                markersize=6,
                label=f"refused ({len(view.refusals)})",
            )
        tenant = key.split("tenant=")[1].split("|")[0] if "tenant=" in key else ""
        for at, _ in (t for t in tally.late if tenant and t[1].startswith(tenant + ":")):
            ax.axvline(at, color="tab:cyan", alpha=0.5, linewidth=1)
        ax.set_title(f"{key}  ({view.unit}, {view.window_s}s window)", fontsize=9)
        ax.set_ylim(0, max(view.limit, max(ys)) * 1.15)
        ax.set_xlabel("seconds since start", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"spendgate demo: {tally.admitted} admitted, {tally.refused} refused, "
        f"{tally.cancelled} cancelled, {tally.late_reports} late reports (cyan lines)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def wait_until_decidable(
    base_url: str, timeout_s: float, *, token: str | None = None, poll_s: float = 0.5
) -> dict[str, Any]:
    """Wait until the admission service is ready (``/readyz``) and the stack can decide
    (``GET /v1/status``: policies materialized and every partition mark vouched).

    Returns:
        The last ``/v1/status`` body.

    Raises:
        TimeoutError: not so within ``timeout_s``; the message says what was missing.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout_s
    missing = f"admission does not answer at {base_url}"
    with httpx.Client(base_url=base_url, timeout=2.0, headers=headers) as http:
        while True:
            try:
                ready = http.get("/readyz")
                answer = http.get("/v1/status") if ready.status_code == 200 else None
                if answer is None:
                    missing = f"admission is not ready (/readyz answered {ready.status_code})"
                elif answer.status_code != 200:
                    missing = f"/v1/status answered {answer.status_code}: {answer.text[:300]}"
                else:
                    status: dict[str, Any] = answer.json()
                    if status["decidable"] and status["policies"]:
                        return status
                    missing = status["reason"] or "no policies are materialized in Redis yet"
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                missing = f"admission does not answer at {base_url}: {exc}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the stack cannot decide after {timeout_s:g} s: {missing}")
            time.sleep(poll_s)


def run_demo(
    base_url: str = "http://127.0.0.1:8787",
    seconds: float = 40.0,
    *,
    chart: str | Path | None = DEFAULT_CHART,
    seed: int | None = None,
    late_reports: bool = True,
    wait_s: float = 0.0,
) -> Tally:
    """Drive admits, streaming generations, cancellations and late usage reports for
    ``seconds``, show the windows fill, and write a PNG chart to ``chart`` (None: no chart).

    With ``wait_s`` > 0, first wait that long at most for the stack to decide
    (:func:`wait_until_decidable`). Late reports go straight to Kafka
    (``SPENDGATE_KAFKA_BOOTSTRAP`` / ``SPENDGATE_TOPIC_PREFIX``, as the worker reads them).
    """
    console = Console()
    if wait_s > 0:
        with console.status("waiting for the stack to decide (GET /v1/status) ..."):
            status = wait_until_decidable(base_url, wait_s)
        console.print(
            f"stack decides: {status['counts']['vouched']} partition marks vouched, "
            f"{status['policies']} policies"
        )
    tally = asyncio.run(_run(base_url, seconds, seed, late_reports))
    console.print(
        f"demo done: {tally.admitted} admitted, {tally.refused} refused, "
        f"{tally.committed} committed, {tally.cancelled} cancelled, "
        f"{tally.late_reports} late reports"
    )
    for line in tally.actions:
        console.print(Text(line))
    if chart is not None and tally.keys:
        written = write_chart(tally, Path(chart))
        console.print(f"chart: {written}")
    return tally
