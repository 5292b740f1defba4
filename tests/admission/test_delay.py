"""``on_exceed: delay`` on a real Redis: held until the request fits, decided again by the same
atomic script; bounded, in arrival order, one outcome per request id, nothing left behind
by a client that disconnects."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import pytest

from spendgate.admission.client import AsyncAdmissionClient
from tests.fixtures.admission import Admission, LiveServer, MakeAdmission
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration

WINDOW_MS = 30_000
BUCKET_MS = 1000


async def _full_window(adm: Admission, policy_id: str, limit: int, ages_in_ms: int) -> int:
    """Fill ``tenant=d``'s window with ``limit`` in one bucket that ages out about
    ``ages_in_ms`` from now; return the exact instant (epoch ms) it ages out."""
    now = int(time.time() * 1000)
    start = now - now % BUCKET_MS
    # An "include" window counts a bucket until window + bucket - 1 ms after its start.
    bucket = start + ages_in_ms - WINDOW_MS - BUCKET_MS
    await adm.usage(f"{policy_id}|tenant=d", {bucket: limit}, BUCKET_MS)
    return bucket + WINDOW_MS + BUCKET_MS - 1


def _policy(policy_factory: PolicyFactory, **fields: Any) -> Any:
    return policy_factory(
        id="held",
        unit="requests",
        window="30s",
        bucket="1s",
        on_exceed="delay",
        **fields,
    )


async def _held(
    make_admission: MakeAdmission,
    policy_factory: PolicyFactory,
    *,
    limit: int = 10,
    ages_in_ms: int = 3000,
    **settings: Any,
) -> tuple[Admission, int]:
    """An admission app with the ``held`` delay policy (max_delay 10 s) whose window for
    ``tenant=d`` is full until about ``ages_in_ms`` from now; and that exact instant."""
    adm = await make_admission(**settings)
    await adm.policies(_policy(policy_factory, limit=limit, max_delay="10s"))
    return adm, await _full_window(adm, "held", limit, ages_in_ms)


class TestDelay:
    async def test_a_delayed_request_is_admitted_when_its_bucket_ages_out(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm, fits_at = await _held(make_admission, policy_factory)
        sent = time.time() * 1000
        answer = await adm.admit("d", requests=1)
        answered = time.time() * 1000
        body = answer.json()
        assert answer.status_code == 200, body
        assert body["decision"] == "allow"
        assert abs(answered - fits_at) <= 1000
        assert abs(body["delayed_ms"] - (fits_at - sent)) <= 1000
        assert await adm.pending("held|tenant=d") == 1

    async def test_200_racing_delayed_requests_never_go_over_the_limit(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm, fits_at = await _held(make_admission, policy_factory)
        answers = await asyncio.gather(*(adm.admit("d", requests=1) for _ in range(200)))
        admitted = [a for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code == 429]
        assert len(admitted) == 10
        assert len(refused) == 190
        assert await adm.pending("held|tenant=d") == 10
        assert time.time() * 1000 >= fits_at
        assert all(a.json()["delayed_ms"] > 0 for a in admitted)
        # Waiting could not help the rest: the 10 just admitted hold the window for 30 s.
        for a in refused:
            assert "max_delay" in a.json()["reason"]
            assert int(a.headers["Retry-After"]) > 10
        assert len(adm.publisher.events) == 10  # type: ignore[attr-defined]

    async def test_a_full_wait_queue_refuses_at_once_naming_why(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm, _ = await _held(make_admission, policy_factory, delay_waiters=2)
        waiting = [asyncio.create_task(adm.admit("d", requests=1)) for _ in range(2)]
        await asyncio.sleep(0.5)
        started = time.monotonic()
        full = await adm.admit("d", requests=1)
        assert time.monotonic() - started < 1.0
        assert full.status_code == 429
        assert "delay queue is full" in full.json()["reason"]
        assert full.headers["Retry-After"] in {"1", "2", "3"}
        assert [a.status_code for a in await asyncio.gather(*waiting)] == [200, 200]

    async def test_a_repeat_joins_the_wait_and_never_reserves_twice(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm, _ = await _held(make_admission, policy_factory, ages_in_ms=2000)
        rid = uuid.uuid4().hex
        first = asyncio.create_task(adm.admit("d", rid, requests=1))
        await asyncio.sleep(0.3)
        second = await adm.admit("d", rid, requests=1)
        assert (await first).json() == second.json()
        assert second.json()["decision"] == "allow"
        assert await adm.pending("held|tenant=d") == 1
        assert adm.publisher.kinds() == ["reserve"]  # type: ignore[attr-defined]

    async def test_waiters_of_a_key_are_served_in_arrival_order(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm, _ = await _held(make_admission, policy_factory, limit=3)
        # Arrivals a little apart; 3 fit once the bucket ages out: the first 3 to arrive.
        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(adm.admit("d", f"order-{i}", requests=1)))
            await asyncio.sleep(0.1)
        answers = await asyncio.gather(*tasks)
        assert [a.status_code for a in answers] == [200, 200, 200, 429, 429, 429]

    async def test_a_client_that_disconnects_while_held_leaves_no_reservation(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm, fits_at = await _held(make_admission, policy_factory, ages_in_ms=2000)
        raw = json.dumps(
            {
                "request_id": uuid.uuid4().hex,
                "subject": {"tenant": "d", "model": "m1"},
                "estimate": {"requests": 1},
            }
        ).encode()
        incoming = [{"type": "http.request", "body": raw, "more_body": False}]
        hang_up = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if incoming:
                return incoming.pop()
            await hang_up.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/admit",
            "raw_path": b"/v1/admit",
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
            ],
            "client": ("127.0.0.1", 5000),
            "server": ("adm", 80),
        }
        app = adm.http._transport.app  # type: ignore[attr-defined]
        call = asyncio.create_task(app(scope, receive, send))
        await asyncio.sleep(0.5)
        assert not call.done()  # held
        hang_up.set()
        await asyncio.wait_for(call, 2)
        assert sent == []
        # Past the instant it would have been admitted: nothing reserved, nothing published.
        await asyncio.sleep(max(0.0, (fits_at - time.time() * 1000) / 1000) + 0.5)
        assert await adm.pending("held|tenant=d") == 0
        assert adm.publisher.kinds() == []  # type: ignore[attr-defined]
        # And the next request is admitted at once.
        assert (await adm.admit("d", requests=1)).json()["decision"] == "allow"


class TestDelayOverHttp:
    async def test_the_client_reads_a_held_answer_past_its_timeout(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        live_admission: LiveServer,
    ) -> None:
        # Policies and window on the same Redis prefix as the live server.
        await _held(make_admission, policy_factory)
        async with AsyncAdmissionClient(
            live_admission.url, "tok-all", timeout_s=0.5, retries=0
        ) as client:
            decision = await client.admit({"tenant": "d", "model": "m1"}, {"requests": 1})
        assert decision.decision == "allow"
        assert decision.delayed_ms is not None and decision.delayed_ms > 1000

    async def test_a_client_that_hangs_up_on_a_real_server_leaves_no_reservation(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        live_admission: LiveServer,
    ) -> None:
        adm, fits_at = await _held(make_admission, policy_factory)
        async with httpx.AsyncClient(base_url=live_admission.url, timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    "/v1/admit",
                    json={
                        "request_id": uuid.uuid4().hex,
                        "subject": {"tenant": "d", "model": "m1"},
                        "estimate": {"requests": 1},
                    },
                    headers={"Authorization": "Bearer tok-all"},
                )
        await asyncio.sleep(max(0.0, (fits_at - time.time() * 1000) / 1000) + 0.5)
        assert await adm.pending("held|tenant=d") == 0
