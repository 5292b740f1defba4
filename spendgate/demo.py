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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.text import Text

from spendgate._demo_chart import write_chart as write_chart
from spendgate._demo_showcase import showcase
from spendgate._demo_view import Clock, Tally, observe, screen
from spendgate._demo_view import KeyView as KeyView

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


async def _one_request(
    http: httpx.AsyncClient, tenant: str, tally: Tally, clock: Clock, rng: random.Random
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
    observe(tally, data.get("budgets", []), clock.now())
    if answer.status_code == 429:
        tally.refused += 1
        wait = "never fits" if data.get("never_fits") else f"{data['retry_after_seconds']}s"
        if answer.headers.get("Retry-After"):
            tally.shown.add("refusal with Retry-After")
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


async def _late_reports(tally: Tally, clock: Clock, seconds: float, rng: random.Random) -> None:
    """Every few seconds an inference worker reports usage late, straight to Kafka (its
    API keys as key ids, as a producer with the deployment's subject secret writes them)."""
    from spendgate.schemas import kafka_connect
    from spendgate.schemas.key_settings import SubjectSecretSettings

    keys = SubjectSecretSettings().key_ids()

    kafka = kafka_connect.KafkaSettings().kafka()
    bootstrap = kafka.bootstrap
    topic = os.environ.get("SPENDGATE_TOPIC_PREFIX", "budget.") + "usage"
    producer = kafka_connect.producer(kafka, acks="all", enable_idempotence=True)
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
                    "api_key": keys.of(rng.choice(TENANTS[tenant]["keys"])),
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


async def _poll_budgets(
    http: httpx.AsyncClient, tally: Tally, clock: Clock, seconds: float
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
                    observe(tally, answer.json().get("budgets", []), clock.now())
        await asyncio.sleep(1.0)


async def _run(base_url: str, seconds: float, seed: int | None, late: bool) -> Tally:
    tally = Tally()
    rng = random.Random(seed)
    clock = Clock()
    pending: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        side = [
            asyncio.create_task(_poll_budgets(http, tally, clock, seconds)),
            asyncio.create_task(showcase(http, tally, clock, seconds)),
        ]
        if late:
            side.append(asyncio.create_task(_late_reports(tally, clock, seconds, rng)))
        with Live(screen(tally, 0), refresh_per_second=4, console=Console()) as live:
            while (elapsed := clock.now()) < seconds:
                for tenant, spec in TENANTS.items():
                    # acme bursts 4x for one second in every ten; globex once in 15 s.
                    burst = 4 if tenant == "acme" and int(elapsed) % 10 == 0 else 1
                    burst = 6 if tenant == "globex" and int(elapsed) % 15 == 7 else burst
                    if rng.random() < spec["rate"] * burst / 10:
                        task = asyncio.create_task(_one_request(http, tenant, tally, clock, rng))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                live.update(screen(tally, elapsed))
                await asyncio.sleep(0.1)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            live.update(screen(tally, clock.now()))
    return tally


async def _read_alerts(tally: Tally, *, timeout_s: float = 20.0) -> None:
    """Count the alerts on the alerts topic by kind (``SPENDGATE_TOPIC_PREFIX``), waiting
    up to ``timeout_s`` for the worker to publish the showcase's overage alert."""
    from spendgate.schemas.kafka_connect import KafkaSettings
    from spendgate.streams.alert_feed import read_alerts

    kafka = KafkaSettings().kafka()
    bootstrap = kafka.bootstrap
    topic = os.environ.get("SPENDGATE_TOPIC_PREFIX", "budget.") + "alerts"
    deadline = time.monotonic() + timeout_s
    while True:
        counts: dict[str, int] = {}
        try:
            async for alert in read_alerts(kafka, topic, from_beginning=True, follow=False):
                counts[alert.kind] = counts.get(alert.kind, 0) + 1
        except Exception as exc:  # noqa: BLE001 - said, and the demo fails on "alerts"
            tally.alerts_error = f"reading {topic} at {bootstrap}: {exc!r}"
        tally.alerts = counts
        if "overage" in counts and "threshold" in counts:
            tally.shown.add("alerts")
            return
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(1.0)


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
    with console.status("reading the alerts back from Kafka ..."):
        asyncio.run(_read_alerts(tally))
    console.print(
        f"demo done: {tally.admitted} admitted, {tally.refused} refused, "
        f"{tally.committed} committed, {tally.cancelled} cancelled, "
        f"{tally.late_reports} late reports"
    )
    for line in tally.actions:
        console.print(Text(line))
    console.print(
        Text(
            "alerts on the alerts topic: "
            + (", ".join(f"{n} {kind}" for kind, n in sorted(tally.alerts.items())) or "none")
            + (f" (last error {tally.alerts_error})" if tally.alerts_error else "")
        )
    )
    if chart is not None and tally.keys:
        written = write_chart(tally, Path(chart))
        console.print(f"chart: {written}")
    return tally
