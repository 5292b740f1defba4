"""spendgate in a real LiteLLM proxy, called by the real ``openai`` SDK and Anthropic's
(real services): every call type admitted, settled from what the provider reported,
refused before the provider sees it, and exact under concurrency.

The proxy (its own process, started once for the session) loads
``spendgate.integrations.litellm.handler`` from its ``config.yaml`` and forwards to the
stub provider (``tests.fixtures.openai_stub``, every route); admission and a worker run on
real Kafka and Redis. What the windows hold is compared with what the stub says it served,
and what the SDK did with what it saw. All of the proxy's tests are in this one file, so
that pytest-xdist (which schedules by file) starts the proxy once.
"""

from __future__ import annotations

import asyncio
import io
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from spendgate.schemas.events import ReleaseEvent, ReserveEvent, UsageEvent, parse_event
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import read_records
from tests.fixtures.litellm_stack import MASTER_KEY, OUTPUT_ALLOWANCE, LiteLLMStack, Sdk, settled
from tests.fixtures.openai_stub import (
    BATCH_LINES,
    BATCH_USAGE,
    CACHED_TOKENS,
    EMBED_TOKENS,
    IMAGE_USAGE,
    PROMPT_TOKENS,
    RERANK_TOKENS,
)

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


async def hang_up_after(stream: Any, pieces: int, is_piece: Callable[[Any], bool]) -> int:
    """Read ``stream`` until ``pieces`` of its items are ``is_piece`` (output), then close
    it: the client hangs up while the provider's stream is still open. Returns how many
    pieces it read."""
    read = 0
    async with asyncio.timeout(30):
        async for item in stream:
            if is_piece(item):
                read += 1
            if read == pieces:
                break
    await stream.close()
    return read


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
        read = await hang_up_after(
            stream, 150, lambda c: bool(c.choices and c.choices[0].delta.content)
        )
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


@pytest.fixture
async def claude(litellm_stack: LiteLLMStack) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """Anthropic's SDK, on the proxy's ``/v1/messages``."""
    client = anthropic.AsyncAnthropic(
        base_url=litellm_stack.proxy_url, api_key=MASTER_KEY, max_retries=0, timeout=60
    )
    yield client
    await client.close()


def meta(tenant: str) -> dict[str, Any]:
    return {"metadata": {"tenant": tenant}}


def micros(cost: str | None) -> int:
    """LiteLLM's cost header in micro-dollars, rounded up as spendgate charges it."""
    assert cost is not None and float(cost) > 0
    return math.ceil(float(cost) * 1_000_000)


class TestResponses:
    async def test_plain_and_streamed_calls_are_settled_as_reported(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        inputs = policy(unit="input_tokens", limit=100_000, count_cached_input=False)
        output = policy(unit="output_tokens", limit=100_000)
        total = policy(unit="total_tokens", limit=100_000)
        await litellm_stack.apply(requests, inputs, output, total)
        client, _ = sdk()
        before = len(litellm_stack.stub.served)
        plain = await client.responses.create(
            model="big", input="tokens=5", metadata={"tenant": tenant}
        )
        stream = await client.responses.create(
            model="big", input="tokens=7", metadata={"tenant": tenant}, stream=True
        )
        deltas = [e async for e in stream if e.type == "response.output_text.delta"]
        served = litellm_stack.stub.served[before:]
        assert [(s.route, s.stream, s.completion_tokens) for s in served] == [
            ("responses", False, 5),
            ("responses", True, 7),
        ]
        # The output allowance reached the provider as the Responses API's own cap.
        assert [s.max_tokens for s in served] == [OUTPUT_ALLOWANCE] * 2
        assert plain.usage is not None and plain.usage.output_tokens == 5
        assert len(deltas) == 7
        settled(
            litellm_stack,
            tenant,
            {
                requests.id: 2,
                inputs.id: 2 * (PROMPT_TOKENS - CACHED_TOKENS),
                output.id: 12,
                total.id: 2 * PROMPT_TOKENS + 12,
            },
        )

    async def test_an_abandoned_stream_is_charged_what_it_produced(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=100)
        output = policy(unit="output_tokens", limit=100_000)
        await litellm_stack.apply(requests, output)
        client, _ = sdk()
        before = len(litellm_stack.stub.served)
        # Three chunks, then the provider holds the stream open, still generating.
        stream = await client.responses.create(
            model="big",
            input="tokens=1000 stall=3",
            max_output_tokens=1000,
            metadata={"tenant": tenant},
            stream=True,
        )
        read = await hang_up_after(stream, 3, lambda e: e.type == "response.output_text.delta")
        [served] = litellm_stack.stub.served[before:]
        assert served.route == "responses" and served.chunks_sent == read == 3
        settled(litellm_stack, tenant, {requests.id: 1, output.id: 3})

    async def test_a_stream_stops_where_an_extend_is_refused(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        output = policy(unit="output_tokens", limit=300)
        await litellm_stack.apply(output)
        client, _ = sdk()
        stream = await client.responses.create(
            model="big",
            input="tokens=1000",
            max_output_tokens=1000,
            metadata={"tenant": tenant},
            stream=True,
        )
        got = [e async for e in stream if e.type == "response.output_text.delta"]
        # Blocks of 100: reserved 100, extended to 200 and 300; the extend to 400 refused.
        assert len(got) == 300
        settled(litellm_stack, tenant, {output.id: 300})


class TestMessages:
    async def test_plain_and_streamed_calls_are_settled_as_reported(
        self,
        litellm_stack: LiteLLMStack,
        claude: anthropic.AsyncAnthropic,
        tenant: str,
        policy: Callable[..., Any],
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        inputs = policy(unit="input_tokens", limit=100_000, count_cached_input=False)
        output = policy(unit="output_tokens", limit=100_000)
        total = policy(unit="total_tokens", limit=100_000)
        await litellm_stack.apply(requests, inputs, output, total)
        before = len(litellm_stack.stub.served)
        plain = await claude.messages.create(
            model="claude",
            max_tokens=50,
            messages=[{"role": "user", "content": "tokens=5"}],
            extra_body=meta(tenant),
        )
        async with claude.messages.stream(
            model="claude",
            max_tokens=50,
            messages=[{"role": "user", "content": "tokens=7"}],
            extra_body=meta(tenant),
        ) as stream:
            text = [t async for t in stream.text_stream]
        served = litellm_stack.stub.served[before:]
        assert [(s.route, s.stream, s.completion_tokens) for s in served] == [
            ("messages", False, 5),
            ("messages", True, 7),
        ]
        assert plain.usage.output_tokens == 5 and "".join(text) == " a" * 7
        settled(
            litellm_stack,
            tenant,
            {
                requests.id: 2,
                inputs.id: 2 * (PROMPT_TOKENS - CACHED_TOKENS),
                output.id: 12,
                total.id: 2 * PROMPT_TOKENS + 12,
            },
        )

    async def test_a_stream_stops_where_an_extend_is_refused(
        self,
        litellm_stack: LiteLLMStack,
        claude: anthropic.AsyncAnthropic,
        tenant: str,
        policy: Callable[..., Any],
    ) -> None:
        output = policy(unit="output_tokens", limit=300)
        await litellm_stack.apply(output)
        got = 0
        # The proxy ends the stream where the extend to 400 is refused: the client gets
        # what fitted and no message_stop (the SDK's stream just ends).
        stream = await claude.messages.create(
            model="claude",
            max_tokens=1000,
            messages=[{"role": "user", "content": "tokens=1000"}],
            extra_body=meta(tenant),
            stream=True,
        )
        async for event in stream:
            if event.type == "content_block_delta":
                got += 1
        assert got == 300
        settled(litellm_stack, tenant, {output.id: 300})

    async def test_an_abandoned_stream_is_charged_what_it_produced(
        self,
        litellm_stack: LiteLLMStack,
        claude: anthropic.AsyncAnthropic,
        tenant: str,
        policy: Callable[..., Any],
    ) -> None:
        requests = policy(unit="requests", limit=100)
        output = policy(unit="output_tokens", limit=100_000)
        await litellm_stack.apply(requests, output)
        before = len(litellm_stack.stub.served)
        stream = await claude.messages.create(
            model="claude",
            max_tokens=1000,
            messages=[{"role": "user", "content": "tokens=1000 stall=3"}],
            extra_body=meta(tenant),
            stream=True,
        )
        read = await hang_up_after(stream, 3, lambda e: e.type == "content_block_delta")
        [served] = litellm_stack.stub.served[before:]
        assert served.route == "messages" and served.chunks_sent == read == 3
        settled(litellm_stack, tenant, {requests.id: 1, output.id: 3})

    async def test_a_refusal_is_anthropic_shaped_and_keeps_its_headers(
        self,
        litellm_stack: LiteLLMStack,
        claude: anthropic.AsyncAnthropic,
        tenant: str,
        policy: Callable[..., Any],
    ) -> None:
        daily = policy(unit="requests", limit=1, window="10m", bucket="1m")
        await litellm_stack.apply(daily)
        ask = {
            "model": "claude",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "tokens=1"}],
            "extra_body": meta(tenant),
        }
        await claude.messages.create(**ask)
        before = len(litellm_stack.stub.served)
        with pytest.raises(anthropic.RateLimitError) as raised:
            await claude.messages.create(**ask)
        assert len(litellm_stack.stub.served) == before
        error = raised.value
        assert error.status_code == 429
        assert isinstance(error.body, dict) and error.body["type"] == "error"
        assert error.body["error"]["type"] == "rate_limit_error"
        assert error.body["error"]["provider_specific_fields"]["spendgate"]["policy"] == daily.id
        assert error.response.headers["x-should-retry"] == "false"
        assert int(error.response.headers["retry-after"]) > 60


class TestOtherCallTypes:
    async def test_embeddings_are_settled_as_reported(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        inputs = policy(unit="input_tokens", limit=100_000)
        await litellm_stack.apply(requests, inputs)
        client, _ = sdk()
        answer = await client.embeddings.create(
            model="embed", input=["one", "two"], extra_body=meta(tenant)
        )
        assert answer.usage.prompt_tokens == 2 * EMBED_TOKENS
        settled(litellm_stack, tenant, {requests.id: 1, inputs.id: 2 * EMBED_TOKENS})

    async def test_a_dollar_budget_without_the_models_price_refuses_embeddings(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        # Embeddings are estimated in tokens, priced by spendgate's catalog as chat is:
        # a model it has no price for is refused (unpriced: reject), never free.
        cost = policy(unit="cost_usd", limit=10_000_000)
        await litellm_stack.apply(cost)
        client, _ = sdk()
        before = len(litellm_stack.stub.on("embeddings"))
        with pytest.raises(openai.UnprocessableEntityError, match="has no price"):
            await client.embeddings.create(model="embed", input="one", extra_body=meta(tenant))
        assert len(litellm_stack.stub.on("embeddings")) == before

    async def test_images_are_settled_as_reported_at_litellms_cost(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        total = policy(unit="total_tokens", limit=100_000)
        cost = policy(unit="cost_usd", limit=10_000_000)
        await litellm_stack.apply(requests, total, cost)
        client, _ = sdk()
        answer = await client.images.with_raw_response.generate(
            model="image", prompt="a cat", extra_body=meta(tenant)
        )
        charged = micros(answer.headers.get("x-litellm-response-cost"))
        assert litellm_stack.stub.on("images")
        settled(
            litellm_stack,
            tenant,
            {requests.id: 1, total.id: sum(IMAGE_USAGE.values()), cost.id: charged},
        )

    async def test_speech_is_one_request_at_litellms_cost(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        cost = policy(unit="cost_usd", limit=10_000_000)
        await litellm_stack.apply(requests, cost)
        client, _ = sdk()
        text = "hello there"
        audio = await client.audio.speech.create(
            model="tts", voice="alloy", input=text, extra_body=meta(tenant)
        )
        assert audio.content.startswith(b"ID3")
        # tts-1: 15 micro-dollars a character, spaces left out (LiteLLM's count).
        settled(litellm_stack, tenant, {requests.id: 1, cost.id: 15 * len(text.replace(" ", ""))})

    async def test_a_transcription_is_one_request_at_litellms_cost(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        cost = policy(unit="cost_usd", limit=10_000_000)
        await litellm_stack.apply(requests, cost)
        client, _ = sdk()
        sound = io.BytesIO(b"RIFF" + b"\x00" * 64)
        sound.name = "a.wav"
        answer = await client.audio.transcriptions.create(
            model="whisper", file=sound, extra_body=meta(tenant)
        )
        assert answer.text == "hello"
        # whisper-1: 0.0001 $/s over the stub's 12 s.
        settled(litellm_stack, tenant, {requests.id: 1, cost.id: 1200})

    async def test_rerank_is_one_request_with_its_tokens(
        self, litellm_stack: LiteLLMStack, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1000)
        inputs = policy(unit="input_tokens", limit=100_000)
        cost = policy(unit="cost_usd", limit=10_000_000)
        await litellm_stack.apply(requests, inputs, cost)
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(
                f"{litellm_stack.proxy_url}/v1/rerank",
                headers={"Authorization": f"Bearer {MASTER_KEY}"},
                json={
                    "model": "rerank",
                    "query": "which",
                    "documents": ["a", "b", "c"],
                    **meta(tenant),
                },
            )
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["results"]) == 3
        # rerank-english-v3.0: 0.002 $ a query.
        settled(
            litellm_stack,
            tenant,
            {requests.id: 1, inputs.id: RERANK_TOKENS, cost.id: 2000},
        )

    async def test_a_batch_submission_is_one_request(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=1)
        await litellm_stack.apply(requests)
        client, _ = sdk()
        batch = await client.batches.create(
            input_file_id="file-abc",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"tenant": tenant},
        )
        assert batch.id.startswith("batch_") and len(litellm_stack.stub.on("batches")) >= 1
        settled(litellm_stack, tenant, {requests.id: 1})
        before = len(litellm_stack.stub.on("batches"))
        # Refused before the provider. LiteLLM 1.108.0 answers every error on this route
        # with a bare 500 unless the proxy's database client (prisma) is installed: its
        # error handler imports it first (proxy/utils.py:9190). With it, the 429.
        with pytest.raises(openai.APIStatusError) as raised:
            await client.batches.create(
                input_file_id="file-abc",
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata={"tenant": tenant},
            )
        assert raised.value.status_code in (429, 500)
        assert len(litellm_stack.stub.on("batches")) == before

    async def test_a_finished_batchs_usage_is_committed_once(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        requests = policy(unit="requests", limit=100)
        inputs = policy(unit="input_tokens", limit=100_000)
        output = policy(unit="output_tokens", limit=100_000)
        cost = policy(unit="cost_usd", limit=10_000_000)
        await litellm_stack.apply(requests, inputs, output, cost)
        client, _ = sdk()
        batch = await client.batches.create(
            input_file_id="file-abc",
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"tenant": tenant},
        )
        settled(litellm_stack, tenant, {requests.id: 1, inputs.id: 0})
        # Each retrieval of the completed batch reports its usage; it counts once.
        for _ in range(2):
            done = await client.batches.retrieve(batch.id)
            assert done.status == "completed"
        lines = BATCH_LINES
        budgets = settled(
            litellm_stack,
            tenant,
            {
                requests.id: 1,
                inputs.id: lines * BATCH_USAGE["prompt_tokens"],
                output.id: lines * BATCH_USAGE["completion_tokens"],
            },
        )
        # gpt-4o-mini at LiteLLM's batch prices, 0.075 $ and 0.30 $ per million input and
        # output tokens: 3 x (40 x 0.075 + 10 x 0.30) = 18 micro-dollars, rounded up from
        # LiteLLM's float sum (a hair above 18 here: 19).
        assert budgets[cost.id]["used"] in (18, 19)

    async def test_an_unknown_call_type_is_counted_as_one_request(
        self, litellm_stack: LiteLLMStack, sdk: Sdk, tenant: str, policy: Callable[..., Any]
    ) -> None:
        # Moderations are not a kind spendgate knows: the default (count) admits and
        # commits them as one request.
        requests = policy(unit="requests", limit=1)
        await litellm_stack.apply(requests)
        client, _ = sdk()
        await client.moderations.create(model="moderation", input="hi", extra_body=meta(tenant))
        settled(litellm_stack, tenant, {requests.id: 1})
        before = len(litellm_stack.stub.on("moderations"))
        with pytest.raises(openai.RateLimitError):
            await client.moderations.create(model="moderation", input="hi", extra_body=meta(tenant))
        assert len(litellm_stack.stub.on("moderations")) == before


class TestRoutesOutsideTheHook:
    @pytest.mark.parametrize(
        "path", ["/v1/threads/thread_1/runs", "/v1/assistants", "/queue/chat/completions"]
    )
    async def test_are_closed_by_allowed_routes(
        self, litellm_stack: LiteLLMStack, closed_proxy_url: str, path: str
    ) -> None:
        before = len(litellm_stack.stub.served)
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(
                f"{closed_proxy_url}{path}",
                headers={"Authorization": f"Bearer {MASTER_KEY}"},
                json={"model": "big", "assistant_id": "a", "messages": []},
            )
        assert answer.status_code == 403, answer.text
        assert "not allowed" in answer.text
        assert len(litellm_stack.stub.served) == before

    async def test_the_metered_routes_stay_open(
        self, litellm_stack: LiteLLMStack, closed_proxy_url: str, tenant: str
    ) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(
                f"{closed_proxy_url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {MASTER_KEY}"},
                json={
                    "model": "big",
                    "messages": [{"role": "user", "content": "tokens=2"}],
                    **meta(tenant),
                },
            )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2


Call = Callable[[], Awaitable[Any]]


def _calls(stack: LiteLLMStack, client: openai.AsyncOpenAI, tenant: str) -> dict[str, Call]:
    """One call of each type (the refused ones raise the SDK's RateLimitError)."""

    async def rerank() -> Any:
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(
                f"{stack.proxy_url}/v1/rerank",
                headers={"Authorization": f"Bearer {MASTER_KEY}"},
                json={"model": "rerank", "query": "q", "documents": ["a"], **meta(tenant)},
            )
        if answer.status_code == 429:
            raise openai.RateLimitError("refused", response=answer, body=answer.json())
        answer.raise_for_status()

    def sound() -> io.BytesIO:
        found = io.BytesIO(b"RIFF" + b"\x00" * 64)
        found.name = "a.wav"
        return found

    return {
        "responses": lambda: client.responses.create(
            model="big", input="tokens=2", metadata={"tenant": tenant}
        ),
        "embeddings": lambda: client.embeddings.create(
            model="embed", input="x", extra_body=meta(tenant)
        ),
        "images": lambda: client.images.generate(
            model="image", prompt="x", extra_body=meta(tenant)
        ),
        "speech": lambda: client.audio.speech.create(
            model="tts", voice="alloy", input="x", extra_body=meta(tenant)
        ),
        "transcription": lambda: client.audio.transcriptions.create(
            model="whisper", file=sound(), extra_body=meta(tenant)
        ),
        "rerank": rerank,
    }


class TestConcurrencyByCallType:
    @pytest.mark.parametrize(
        "route",
        ["responses", "messages", "embeddings", "images", "speech", "transcription", "rerank"],
    )
    async def test_50_racing_calls_admit_exactly_10(
        self,
        litellm_stack: LiteLLMStack,
        sdk: Sdk,
        claude: anthropic.AsyncAnthropic,
        tenant: str,
        policy: Callable[..., Any],
        route: str,
    ) -> None:
        requests = policy(unit="requests", limit=10)
        await litellm_stack.apply(requests)
        client, _ = sdk()
        calls = _calls(litellm_stack, client, tenant)

        async def message() -> Any:
            return await claude.messages.create(
                model="claude",
                max_tokens=10,
                messages=[{"role": "user", "content": "tokens=2"}],
                extra_body=meta(tenant),
            )

        call = message if route == "messages" else calls[route]
        before = len(litellm_stack.stub.on(route))

        async def one() -> bool:
            try:
                await call()
            except (openai.RateLimitError, anthropic.RateLimitError):
                return False
            return True

        results = await asyncio.gather(*(one() for _ in range(50)))
        assert results.count(True) == 10 and results.count(False) == 40
        assert len(litellm_stack.stub.on(route)) - before == 10
        settled(litellm_stack, tenant, {requests.id: 10})
