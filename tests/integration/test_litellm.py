"""spendgate in a real LiteLLM proxy, called by the real ``openai`` SDK (real services).

The proxy (its own process) loads ``spendgate.integrations.litellm.handler`` from its
``config.yaml`` and forwards to the OpenAI stub (``tests.fixtures.openai_stub``); admission
and a worker run on real Kafka and Redis. What the windows hold is compared with what the
stub says it served, and what the SDK did with what it saw.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import openai
import pytest

from spendgate.schemas.events import ReleaseEvent, ReserveEvent, UsageEvent, parse_event
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import read_records
from tests.fixtures.litellm_stack import OUTPUT_ALLOWANCE, LiteLLMStack, Sdk, settled
from tests.fixtures.openai_stub import PROMPT_TOKENS

pytestmark = pytest.mark.integration


async def chat(
    client: openai.AsyncOpenAI, tenant: str, text: str, model: str = "big", **extra: Any
) -> Any:
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        extra_body={"metadata": {"tenant": tenant}},
        **extra,
    )


async def usage_events(
    stack: LiteLLMStack,
    tenant: str,
    until: Callable[[list[UsageEvent]], bool],
    timeout_s: float = 30.0,
) -> list[UsageEvent]:
    """The usage topic's events of ``tenant`` (in order: one subject, one partition) once
    ``until`` holds of them, or whatever is there after ``timeout_s`` (the caller asserts)."""
    s = stack.worker_settings
    deadline = time.monotonic() + timeout_s
    while True:
        records = await read_records(s.kafka_bootstrap, s.topic("usage"))
        events = [parse_event(r.value) for r in records if r.value is not None]
        mine = [e for e in events if e.subject.tenant == tenant]
        if until(mine) or time.monotonic() > deadline:
            return mine
        await asyncio.sleep(0.2)


@pytest.fixture
def tenant() -> str:
    return f"team-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def policy(policy_factory: PolicyFactory, tenant: str) -> Callable[..., Any]:
    """A policy on this test's tenant alone (1 h window unless told otherwise)."""

    def make(**fields: Any) -> Any:
        base = {"match": {"tenant": tenant}, "window": "1h", "bucket": "1m"}
        return policy_factory(**{**base, **fields})

    return make


class TestAdmitAndCommit:
    async def test_the_windows_hold_what_the_provider_reported(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        output = policy(unit="output_tokens", limit=100_000)
        total = policy(unit="total_tokens", limit=100_000)
        await litellm_stack.apply(requests, output, total)
        before = len(litellm_stack.stub.served)
        client, _ = sdk()
        plain = await chat(client, tenant, "tokens=5")
        await chat(client, tenant, "tokens=7")
        stream = await chat(client, tenant, "tokens=9", stream=True)
        streamed = [c async for c in stream if c.choices and c.choices[0].delta.content]
        served = litellm_stack.stub.served[before:]
        assert [s.completion_tokens for s in served] == [5, 7, 9]
        assert len(streamed) == 9 and plain.usage is not None
        assert plain.usage.completion_tokens == 5
        # A request without max_tokens reached the provider with the output allowance.
        assert [s.max_tokens for s in served] == [OUTPUT_ALLOWANCE] * 3
        out = sum(s.completion_tokens for s in served)
        settled(
            litellm_stack,
            tenant,
            {requests.id: 3, output.id: out, total.id: 3 * PROMPT_TOKENS + out},
        )


class TestRefusals:
    async def test_a_short_wait_is_retried_by_the_sdk_and_then_admitted(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        once = policy(unit="requests", limit=1, window="30s", bucket="1s")
        await litellm_stack.apply(once)
        client, seen = sdk(max_retries=3)
        await chat(client, tenant, "tokens=1")
        seen.attempts, seen.answers = 0, []
        started = time.monotonic()
        await chat(client, tenant, "tokens=1")
        refused = [a for a in seen.answers if a.status_code == 429]
        assert refused and seen.attempts == len(refused) + 1
        first = refused[0]
        wait_s = int(first.headers["retry-after"])
        # The first request leaves the 30 s window within its 1 s bucket after it.
        assert 1 <= wait_s <= 31
        assert first.headers["retry-after-ms"] == str(wait_s * 1000)
        assert first.headers["x-should-retry"] == "true"
        assert time.monotonic() - started >= wait_s * 0.9

    async def test_a_wait_over_a_minute_is_not_retried(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        daily = policy(unit="requests", limit=1, window="10m", bucket="1m")
        await litellm_stack.apply(daily)
        client, seen = sdk(max_retries=3)
        await chat(client, tenant, "tokens=1")
        seen.attempts = 0
        with pytest.raises(openai.RateLimitError) as raised:
            await chat(client, tenant, "tokens=1")
        assert seen.attempts == 1
        error = raised.value
        assert error.response.headers["x-should-retry"] == "false"
        assert int(error.response.headers["retry-after"]) > 60
        assert isinstance(error.body, dict) and error.body["type"] == "insufficient_quota"
        details = error.body["provider_specific_fields"]["spendgate"]
        assert details["violated"] == [daily.id] and details["policy"] == daily.id
        assert details["remaining"] == 0 and details["retry_after_seconds"] > 60

    async def test_a_request_that_never_fits_is_not_retried(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        small = policy(unit="output_tokens", limit=50)
        await litellm_stack.apply(small)
        client, seen = sdk(max_retries=3)
        before = len(litellm_stack.stub.served)
        with pytest.raises(openai.RateLimitError) as raised:
            await chat(client, tenant, "tokens=5", max_tokens=500)
        assert seen.attempts == 1 and len(litellm_stack.stub.served) == before
        assert raised.value.response.headers["x-should-retry"] == "false"
        assert isinstance(raised.value.body, dict)
        assert raised.value.body["provider_specific_fields"]["spendgate"]["never_fits"] is True


class TestActions:
    async def test_cap_lowers_max_tokens_to_what_remains(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        capped = policy(unit="output_tokens", limit=300, on_exceed="cap")
        await litellm_stack.apply(capped)
        client, _ = sdk()
        await chat(client, tenant, "tokens=250", max_tokens=250)
        answer = await chat(client, tenant, "tokens=200", max_tokens=200)
        served = litellm_stack.stub.served[-1]
        assert served.max_tokens == 50 and served.completion_tokens == 50
        assert answer.usage is not None and answer.usage.completion_tokens == 50
        settled(litellm_stack, tenant, {capped.id: 300})

    async def test_downgrade_sends_the_request_to_the_cheaper_model(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        big = policy(
            unit="requests",
            limit=1,
            match={"tenant": tenant, "model": "big"},
            on_exceed="downgrade",
            downgrade_to="small",
        )
        await litellm_stack.apply(big)
        client, _ = sdk()
        await chat(client, tenant, "tokens=3")
        await chat(client, tenant, "tokens=3")
        assert [s.model for s in litellm_stack.stub.served[-2:]] == ["big", "small"]
        settled(litellm_stack, tenant, {big.id: 1}, model="big")


class TestStreams:
    async def test_a_stream_stops_where_an_extend_is_refused(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        output = policy(unit="output_tokens", limit=300)
        await litellm_stack.apply(output)
        client, _ = sdk()
        stream = await chat(client, tenant, "tokens=1000", max_tokens=1000, stream=True)
        got = [c async for c in stream if c.choices and c.choices[0].delta.content]
        # Blocks of 100: reserved 100, extended to 200 and 300; the extend to 400 refused.
        assert len(got) == 300
        settled(litellm_stack, tenant, {output.id: 300})

    async def test_an_abandoned_stream_is_charged_what_it_produced(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=100)
        output = policy(unit="output_tokens", limit=100_000)
        await litellm_stack.apply(requests, output)
        client, _ = sdk()
        before = len(litellm_stack.stub.served)
        # The provider sends 150 of its 1000 tokens (past the first block of 100, so the
        # reservation was extended to 200) and then holds the stream open, still generating.
        stream = await chat(client, tenant, "tokens=1000 stall=150", max_tokens=1000, stream=True)
        read = 0
        async with asyncio.timeout(30):
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    read += 1
                if read == 150:
                    break
        await stream.close()  # the client hangs up while the provider's stream is open
        [served] = litellm_stack.stub.served[before:]
        assert served.stream and served.completion_tokens == 1000
        assert served.chunks_sent == read == 150
        # Committed (the request counts), not released: exactly the tokens the provider
        # streamed before the client went away (neither the 200 reserved nor the 1000).
        settled(litellm_stack, tenant, {requests.id: 1, output.id: served.chunks_sent})


class TestFailures:
    async def test_a_provider_error_releases_the_reservation(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=100)
        await litellm_stack.apply(requests)
        client, _ = sdk()
        before = len(litellm_stack.stub.served)
        with pytest.raises(openai.InternalServerError):
            await chat(client, tenant, "fail")
        assert [s.status for s in litellm_stack.stub.served[before:]] == [500]
        settled(litellm_stack, tenant, {requests.id: 0})
        # Admitted (a reservation was made and published) and then released, not
        # committed and not left to expire.
        events = await usage_events(
            litellm_stack, tenant, lambda es: any(e.kind != "reserve" for e in es)
        )
        assert [e.kind for e in events] == ["reserve", "release"]
        reserve, release = events
        assert isinstance(reserve, ReserveEvent) and isinstance(release, ReleaseEvent)
        assert reserve.usage.requests == 1
        assert release.reservation_id == reserve.reservation_id

    async def test_an_sdk_retry_is_counted_once(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=100)
        output = policy(unit="output_tokens", limit=100_000)
        await litellm_stack.apply(requests, output)
        client, seen = sdk(max_retries=2)
        answer = await chat(client, tenant, f"fail-once={uuid.uuid4().hex} tokens=5")
        assert seen.attempts == 2 and [a.status_code for a in seen.answers] == [500, 200]
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        settled(litellm_stack, tenant, {requests.id: 1, output.id: 5})


class TestConcurrency:
    async def test_200_racing_calls_admit_exactly_the_limit(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=50)
        await litellm_stack.apply(requests)
        client, _ = sdk()
        before = len(litellm_stack.stub.served)

        async def one() -> bool:
            try:
                await chat(client, tenant, "tokens=2")
            except openai.RateLimitError:
                return False
            return True

        results = await asyncio.gather(*(one() for _ in range(200)))
        assert results.count(True) == 50 and results.count(False) == 150
        assert len(litellm_stack.stub.served) - before == 50
        settled(litellm_stack, tenant, {requests.id: 50})
