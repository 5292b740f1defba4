"""The enforcement actions the demo shows once each on tenant ``hooli``.

On ``examples/demo-policies.yaml``: a burst, a route, a stream stopped by a refused extend,
an overage and a delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from rich.markup import escape

from spendgate._demo_view import Clock, Tally, observe

__all__ = ["showcase", "stream_and_overage"]


async def showcase(http: httpx.AsyncClient, tally: Tally, clock: Clock, seconds: float) -> None:
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
        observe(tally, answer.json().get("budgets", []), clock.now())
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
    if refused and refused[0].headers.get("Retry-After"):
        tally.shown.update({"burst", "refusal with Retry-After"})
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
    if body.get("decision") == "route" and body.get("route_to") == "gpu-west":
        tally.shown.add("route")
    say(
        f"route: third request on gpu-east answered {body.get('decision')}"
        f" -> {body.get('route_to')}"
    )
    # delay: 2 haiku now fill the 30 s window; one more ~22 s later is held until it fits
    # (within its 10 s max_delay). The stream and the overage run meanwhile: however long
    # the overage waits for the worker, the third request comes at its planned instant.
    await asyncio.gather(admit("claude-haiku-4"), admit("claude-haiku-4"))
    third_at = min(seconds - 12, clock.now() + 22)
    tally.shown.update(await stream_and_overage(http, say))
    await asyncio.sleep(max(0.0, third_at - clock.now()))
    say("delay: a third haiku request arrives; the window is full, it will be held...")
    held = (await admit("claude-haiku-4")).json()
    if held.get("decision") == "allow" and held.get("delayed_ms", 0) > 0:
        tally.shown.add("delay")
    say(
        f"delay: answered {held.get('decision')} after {held.get('delayed_ms', 0)} ms"
        + (f" ({held['reason']})" if held.get("reason") else "")
    )


async def stream_and_overage(
    http: httpx.AsyncClient, say: Callable[[str], None], absorb_timeout_s: float = 15.0
) -> set[str]:
    """A stream stopped by a refused extend, then an overage (policy hooli-stream-output);
    the overage shows once the worker applied the commit (``absorb_timeout_s`` at most).

    Returns:
        What it showed: ``stream stopped by a refused extend`` and ``overage``.
    """
    shown: set[str] = set()

    def subject(key: str) -> dict[str, Any]:
        return {
            "tenant": "hooli",
            "api_key": key,
            "model": "claude-opus-4",
            "labels": {"demo": "stream"},
        }

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
        return shown
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
    if "hooli-stream-output" in violated:
        shown.add("stream stopped by a refused extend")
    say(
        f"stream: {seq - 1} extends granted, stopped at {used} output tokens when extend {seq} "
        f"was refused (remaining {left}); committed {used}"
    )
    # Overage: estimated 200, used 500.
    over = await admit("hooli-stream-b", 200)
    if over.status_code == 200:
        await commit(over.json()["reservation_id"], 500)
        # Once the worker applied the commit (nothing reserved is left on the key), what
        # the next admit reserves is its own estimate, scaled by cap_next.
        recorded = await _absorbed(http, subject("hooli-stream-b"), 500, absorb_timeout_s)
        again = await admit("hooli-stream-b", 200)
        budgets = again.json().get("budgets", [])
        held = next((b["reserved"] for b in budgets if b["policy"] == "hooli-stream-output"), "?")
        if again.status_code == 200:
            await commit(again.json()["reservation_id"], 200)
        if recorded and isinstance(held, int) and held > 200:
            shown.add("overage")
        say(
            "overage: estimated 200, committed 500: charged in full, an overage alert "
            f"(spendgate alerts tail); cap_next holds the next 200 estimate at {held}"
            if recorded
            else f"overage: estimated 200, committed 500; the worker did not apply it within "
            f"{absorb_timeout_s:g} s, so cap_next could not show"
        )
    return shown


async def _absorbed(
    http: httpx.AsyncClient, subject: dict[str, Any], used: int, timeout_s: float
) -> bool:
    """Whether the worker applied the commit within ``timeout_s``: policy
    hooli-stream-output for ``subject`` reads ``used`` and nothing reserved."""
    params = {k: v for k, v in subject.items() if k != "labels"}
    params.update({f"labels.{k}": v for k, v in subject.get("labels", {}).items()})
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            answer = await http.get("/v1/budgets", params=params)
            for b in answer.json().get("budgets", []):
                mine = b["policy"] == "hooli-stream-output"
                if mine and b["used"] >= used and b["reserved"] == 0:
                    return True
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.25)
