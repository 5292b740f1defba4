"""The admission client, sync and async, against the real service (uvicorn, Redis, Kafka)."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import redis.asyncio as aioredis

from spendgate.admission.client import AdmissionClient, AsyncAdmissionClient
from spendgate.admission.exceptions import (
    AdmissionRequestError,
    AdmissionUnavailable,
    BudgetExceeded,
)
from spendgate.schemas.events import Usage, parse_event
from spendgate.schemas.redis_keys import reservation_key
from spendgate.streams.materialize import RedisMaterializer
from tests.fixtures import held
from tests.fixtures.admission import TOPOLOGY, VOUCHED, LiveServer
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import read_all

pytestmark = pytest.mark.integration

SUBJECT = {"tenant": "acme", "model": "m1"}
ESTIMATE = {"input_tokens": 100, "output_tokens": 50}


class DropFirstAdmit(httpx.HTTPTransport):
    """Delivers the first admit, then loses its answer as a dropped connection would."""

    def __init__(self) -> None:
        super().__init__()
        self.admits: list[bytes] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path == "/v1/admit":
            self.admits.append(request.content)
            if len(self.admits) == 1:
                response.read()
                response.close()
                raise httpx.ReadError("connection reset by peer", request=request)
        return response


class AsyncDropFirstAdmit(httpx.AsyncHTTPTransport):
    """The asyncio twin of :class:`DropFirstAdmit`."""

    def __init__(self) -> None:
        super().__init__()
        self.admits: list[bytes] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path == "/v1/admit":
            self.admits.append(request.content)
            if len(self.admits) == 1:
                await response.aread()
                await response.aclose()
                raise httpx.ReadError("connection reset by peer", request=request)
        return response


@pytest.fixture
async def server(
    live_admission: LiveServer, redis_client: aioredis.Redis, policy_factory: PolicyFactory
) -> LiveServer:
    policy = policy_factory(id="tok", limit=1000, unit="total_tokens")
    await RedisMaterializer(redis_client, live_admission.settings.redis_prefix).stand_in(
        [policy], TOPOLOGY, VOUCHED
    )
    await asyncio.sleep(0.1)  # the server re-reads policies every 50 ms
    return live_admission


async def _pending(client: aioredis.Redis, server: LiveServer) -> int:
    return await held.apending_sum(client, server.settings.redis_prefix, "tok|tenant=acme")


async def _settled(client: aioredis.Redis, server: LiveServer, rid: str) -> str | None:
    raw = await client.hget(reservation_key(server.settings.redis_prefix, rid), "settled")
    return raw.decode() if raw else None


class TestSyncClient:
    async def test_generation_paths(self, server: LiveServer, redis_client: aioredis.Redis) -> None:
        def run() -> list[str]:
            ids = []
            with AdmissionClient(server.url, "tok-acme") as client:
                with client.generation(SUBJECT, ESTIMATE) as gen:
                    gen.report(Usage(input_tokens=100, output_tokens=20))
                ids.append(gen.reservation_id)
                with client.generation(SUBJECT, ESTIMATE) as gen:
                    pass
                ids.append(gen.reservation_id)
                with pytest.raises(RuntimeError), client.generation(SUBJECT, ESTIMATE) as gen:
                    gen.report({"input_tokens": 100, "output_tokens": 7})
                    raise RuntimeError("model crashed")
                ids.append(gen.reservation_id)
                with pytest.raises(KeyboardInterrupt), client.generation(SUBJECT, ESTIMATE) as gen:
                    raise KeyboardInterrupt
                ids.append(gen.reservation_id)
            return ids

        ids = await asyncio.to_thread(run)
        states = [await _settled(redis_client, server, rid) for rid in ids]
        assert states == ["commit", "release", "commit", "release"]

    async def test_retry_after_a_dropped_connection_reuses_the_request_id(
        self, server: LiveServer, redis_client: aioredis.Redis
    ) -> None:
        transport = DropFirstAdmit()

        def run() -> str | None:
            with AdmissionClient(server.url, "tok-acme", transport=transport) as client:
                return client.admit(SUBJECT, ESTIMATE).reservation_id

        rid = await asyncio.to_thread(run)
        assert len(transport.admits) == 2 and transport.admits[0] == transport.admits[1]
        assert rid is not None
        # The first try reserved; the retry got the same reservation and held nothing more.
        assert await _pending(redis_client, server) == 150

    async def test_errors(self, server: LiveServer) -> None:
        def run() -> None:
            with AdmissionClient(server.url, "tok-acme") as client:
                with pytest.raises(BudgetExceeded) as caught:
                    client.admit(SUBJECT, {"input_tokens": 5000})
                assert caught.value.never_fits and caught.value.violated == ["tok"]
                client.admit(SUBJECT, {"input_tokens": 900})
                with pytest.raises(BudgetExceeded) as caught:
                    client.admit(SUBJECT, {"input_tokens": 200})
                assert caught.value.retry_after_seconds is not None
                with pytest.raises(AdmissionRequestError) as denied:
                    client.admit({"tenant": "other"}, ESTIMATE)
                assert denied.value.status == 403
            with AdmissionClient(server.url, "bad") as client, pytest.raises(AdmissionRequestError):
                client.release("x")
            with (
                AdmissionClient("http://127.0.0.1:1", retries=1, backoff_s=0) as client,
                pytest.raises(AdmissionUnavailable),
            ):
                client.admit(SUBJECT, ESTIMATE)

        await asyncio.to_thread(run)


class TestAsyncClient:
    async def test_generation_paths_including_cancellation(
        self, server: LiveServer, redis_client: aioredis.Redis
    ) -> None:
        ids = []
        async with AsyncAdmissionClient(server.url, "tok-acme") as client:
            async with client.generation(SUBJECT, ESTIMATE) as gen:
                gen.report({"input_tokens": 100, "output_tokens": 30})
            ids.append(gen.reservation_id)
            async with client.generation(SUBJECT, ESTIMATE) as gen:
                pass
            ids.append(gen.reservation_id)
            with pytest.raises(ValueError):
                async with client.generation(SUBJECT, ESTIMATE) as gen:
                    gen.report({"input_tokens": 100, "output_tokens": 3})
                    raise ValueError("stream broke")
            ids.append(gen.reservation_id)

            started = asyncio.Event()
            holder: list[str] = []

            async def generate() -> None:
                async with client.generation(SUBJECT, ESTIMATE) as g:
                    holder.append(g.reservation_id)
                    g.report({"input_tokens": 100, "output_tokens": 1})
                    started.set()
                    await asyncio.sleep(30)

            task = asyncio.create_task(generate())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            ids.append(holder[0])
        states = [await _settled(redis_client, server, rid) for rid in ids]
        assert states == ["commit", "release", "commit", "commit"]

    async def test_retry_after_a_dropped_connection_reuses_the_request_id(
        self, server: LiveServer, redis_client: aioredis.Redis
    ) -> None:
        transport = AsyncDropFirstAdmit()
        request_id = uuid.uuid4().hex
        async with AsyncAdmissionClient(server.url, "tok-acme", transport=transport) as client:
            decision = await client.admit(SUBJECT, ESTIMATE, request_id=request_id)
            again = await client.admit(SUBJECT, ESTIMATE, request_id=request_id)
        assert len(transport.admits) == 3
        assert decision.reservation_id == again.reservation_id
        assert await _pending(redis_client, server) == 150


class TestStreams:
    async def test_sync_stream_extends_stops_when_refused_and_commits_what_it_used(
        self, server: LiveServer, redis_client: aioredis.Redis
    ) -> None:
        def run() -> tuple[str, int, bool, Usage]:
            produced = 0
            client = AdmissionClient(server.url, "tok-acme")
            first, step = {"output_tokens": 200}, {"output_tokens": 300}
            with client, client.stream(SUBJECT, first, step) as s:
                for produced in range(50, 2001, 50):
                    if not s.report({"output_tokens": produced}):
                        break
            return s.reservation_id, produced, s.stopped, s.reserved

        rid, produced, stopped, reserved = await asyncio.to_thread(run)
        # 200 reserved, then 500, 800; at 850 the extend to 1,100 on the 1,000 limit failed.
        assert (produced, stopped, reserved) == (850, True, Usage(output_tokens=800))
        assert await _pending(redis_client, server) == 800  # no worker here: still pending
        assert await _settled(redis_client, server, rid) == "commit"
        settings = server.settings
        events = [
            parse_event(raw)
            for raw in await read_all(settings.kafka_bootstrap, settings.topic("usage"))
        ]
        mine = [e for e in events if getattr(e, "reservation_id", None) == rid]
        assert [e.kind for e in mine] == ["reserve", "extend", "extend", "commit"]
        assert mine[-1].usage == Usage(output_tokens=850)  # type: ignore[union-attr]

    async def test_async_stream_commits_on_cancellation(
        self, server: LiveServer, redis_client: aioredis.Redis
    ) -> None:
        started = asyncio.Event()
        holder: dict[str, str] = {}

        async def generate() -> None:
            client = AsyncAdmissionClient(server.url, "tok-acme")
            async with client, client.stream(SUBJECT, {"output_tokens": 100}) as s:
                holder["rid"] = s.reservation_id
                assert await s.report({"output_tokens": 150})  # extends by 100
                started.set()
                await asyncio.sleep(60)  # the client goes away mid-stream

        task = asyncio.create_task(generate())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _settled(redis_client, server, holder["rid"]) == "commit"
        assert await _pending(redis_client, server) == 200
