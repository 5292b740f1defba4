"""Every LiteLLM call type through a real proxy: admitted, settled from what the provider
reported, refused before the provider sees it, and exact under concurrency.

The proxy (started once for the session, ``tests.fixtures.litellm_stack``) forwards to the
stub (``tests.fixtures.openai_stub``), which serves every route; the real ``openai`` SDK
calls the OpenAI routes and Anthropic's SDK ``/v1/messages``.
"""

from __future__ import annotations

import asyncio
import io
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.fixtures.factories import PolicyFactory
from tests.fixtures.litellm_stack import MASTER_KEY, OUTPUT_ALLOWANCE, LiteLLMStack, Sdk, settled
from tests.fixtures.openai_stub import (
    CACHED_TOKENS,
    EMBED_TOKENS,
    IMAGE_USAGE,
    PROMPT_TOKENS,
    RERANK_TOKENS,
)

pytestmark = pytest.mark.integration


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
        read = 0
        async with asyncio.timeout(30):
            async for event in stream:
                if event.type == "response.output_text.delta":
                    read += 1
                if read == 3:
                    break
        await stream.close()  # the client hangs up while the provider's stream is open
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
        self, litellm_stack: LiteLLMStack, path: str
    ) -> None:
        before = len(litellm_stack.stub.served)
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(
                f"{litellm_stack.proxy_url}{path}",
                headers={"Authorization": f"Bearer {MASTER_KEY}"},
                json={"model": "big", "assistant_id": "a", "messages": []},
            )
        assert answer.status_code == 403, answer.text
        assert "not allowed" in answer.text
        assert len(litellm_stack.stub.served) == before


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


class TestConcurrency:
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
