"""The LiteLLM callback when admission cannot be reached: bounded waits, then the failure
mode of the matching policies (read from the real policies topic) decides."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from spendgate.streams.policy_admin import publish_policies
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import free_port
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.litellm_stack import KEY

if TYPE_CHECKING:
    from spendgate.integrations.litellm import SpendgateLogger

pytestmark = pytest.mark.integration


def _data(text: str = "hello") -> dict[str, Any]:
    return {"model": "big", "messages": [{"role": "user", "content": text}]}


@pytest.fixture(params=["silent", "trickling"])
async def stuck_admission(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """An address that accepts connections and never finishes answering: ``silent`` sends
    nothing; ``trickling`` sends a response's first bytes and then one more every 0.1 s,
    so no read ever times out."""
    held: list[asyncio.StreamWriter] = []
    tasks: list[asyncio.Task[None]] = []

    async def trickle(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(b"HTTP/1.1 200 OK\r\nx-pad: ")
            while True:
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.write(b"a")

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        if request.param == "trickling":
            tasks.append(asyncio.ensure_future(trickle(writer)))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    for task in tasks:
        task.cancel()
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


async def _handler(litellm_callback: ModuleType, **settings: Any) -> SpendgateLogger:
    handler: SpendgateLogger = litellm_callback.SpendgateLogger(
        litellm_callback.LiteLLMSettings(**settings)
    )
    await handler.start()
    return handler


class TestUnreachable:
    async def test_a_stuck_admission_is_given_up_on_within_the_deadline(
        self, litellm_callback: ModuleType, stuck_admission: str
    ) -> None:
        # An admit's answer is read for up to timeout_s + 60 s (a delay policy may hold it
        # that long), so the two tries alone would wait over 120 s for a silent admission
        # and forever for a trickling one; the admit deadline, 0.3 * 2 + 0 + 1 = 1.6 s,
        # is what ends the wait.
        handler = await _handler(
            litellm_callback, admission_url=stuck_admission, timeout_s=0.3, retries=1, max_hold_s=0
        )
        started = time.monotonic()
        with pytest.raises(litellm_callback.SpendgateRefusal) as refused:
            # A guard, far above the deadline: without it a missing deadline hangs the test.
            async with asyncio.timeout(15):
                await handler.async_pre_call_hook(KEY, None, _data(), "acompletion")
        took = time.monotonic() - started
        # At least 1.5 s: the deadline ended the wait, not a per-try timeout or an error.
        assert 1.5 <= took <= 3.0
        assert refused.value.status_code == 503
        assert refused.value.headers["x-should-retry"] == "true"
        await handler.aclose()

    async def test_without_known_policies_the_setting_decides(
        self, litellm_callback: ModuleType
    ) -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        closed = await _handler(litellm_callback, admission_url=dead, retries=0)
        with pytest.raises(litellm_callback.SpendgateRefusal) as refused:
            await closed.async_pre_call_hook(KEY, None, _data(), "acompletion")
        # Refused as unavailable (retry soon), not as over budget.
        assert refused.value.status_code == 503
        assert refused.value.type == "service_unavailable"
        assert refused.value.headers["x-should-retry"] == "true"
        opened = await _handler(litellm_callback, admission_url=dead, retries=0, unavailable="open")
        data = await opened.async_pre_call_hook(KEY, None, _data(), "acompletion")
        assert data["model"] == "big" and data["max_tokens"] == 1024
        await closed.aclose()
        await opened.aclose()

    async def test_the_policies_failure_modes_decide(
        self,
        litellm_callback: ModuleType,
        worker_settings: WorkerSettings,
        policy_factory: PolicyFactory,
    ) -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        strict = policy_factory(unit="requests", limit=100, match={"tenant": "strict"})
        lenient = policy_factory(
            unit="requests", limit=100, match={"tenant": "lenient"}, failure="open"
        )
        local = policy_factory(
            unit="requests",
            limit=10,
            match={"tenant": "local"},
            failure="degraded",
            degraded_allowance=0.2,
        )
        await publish_policies(worker_settings, [strict, lenient, local])
        handler = await _handler(
            litellm_callback,
            admission_url=dead,
            retries=0,
            kafka_bootstrap=worker_settings.kafka_bootstrap,
            topic_prefix=worker_settings.topic_prefix,
        )

        async def call(team: str) -> int:
            key = SimpleNamespace(api_key="hash-1", team_id=team)
            try:
                await handler.async_pre_call_hook(key, None, _data(), "acompletion")
            except litellm_callback.SpendgateRefusal as exc:
                return exc.status_code
            return 200

        assert await call("strict") == 503
        assert [await call("lenient") for _ in range(3)] == [200, 200, 200]
        # Degraded: this proxy's own allowance, 20% of 10 per window.
        assert [await call("local") for _ in range(3)] == [200, 200, 429]
        await handler.aclose()
