"""The LiteLLM callback in process: call types it does not know (``UNMETERED``), what each
call type is, and the usage each answer shape reports (no proxy, no services)."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from spendgate.schemas.events import Usage
from tests.fixtures.admission import free_port
from tests.fixtures.litellm_stack import KEY

# No service: admission is an address nobody listens on (not marked integration).


@pytest.fixture(scope="module")
def calls(litellm_callback: ModuleType) -> ModuleType:
    return importlib.import_module("spendgate.integrations.litellm_calls")


def _handler(litellm_callback: ModuleType, **settings: Any) -> Any:
    # A dead admission: an admit would fail closed (503), so a 403 or a pass shows the
    # unmetered setting decided without asking admission.
    dead = f"http://127.0.0.1:{free_port()}"
    return litellm_callback.SpendgateLogger(
        litellm_callback.LiteLLMSettings(admission_url=dead, retries=0, **settings)
    )


def _count(litellm_callback: ModuleType, call_type: str, mode: str) -> float:
    value = litellm_callback.UNMETERED.labels(call_type=call_type, mode=mode)._value.get()
    return float(value)


def _decided(litellm_callback: ModuleType, decision: str, call_type: str) -> float:
    value = litellm_callback.DECISIONS.labels(decision=decision, call_type=call_type)._value.get()
    return float(value)


class TestUnmetered:
    async def test_reject_refuses_an_unknown_call_type_with_a_clear_error(
        self, litellm_callback: ModuleType
    ) -> None:
        handler = _handler(litellm_callback, unmetered="reject")
        before = _count(litellm_callback, "avideo_generation", "reject")
        decided = _decided(litellm_callback, "reject", "avideo_generation")
        with pytest.raises(litellm_callback.SpendgateRefusal) as refused:
            await handler.async_pre_call_hook(
                KEY, None, {"model": "sora", "prompt": "x"}, "avideo_generation"
            )
        error = refused.value
        assert error.status_code == 403 and error.type == "unmetered_call_type"
        assert "'avideo_generation'" in error.message
        assert "SPENDGATE_LITELLM_UNMETERED=reject" in error.message
        assert error.headers["x-should-retry"] == "false"
        assert error.provider_specific_fields["spendgate"]["call_type"] == "avideo_generation"
        assert _count(litellm_callback, "avideo_generation", "reject") == before + 1
        assert _decided(litellm_callback, "reject", "avideo_generation") == decided + 1
        # Known call types are still admitted (here: admission unreachable, closed).
        with pytest.raises(litellm_callback.SpendgateRefusal) as unavailable:
            await handler.async_pre_call_hook(KEY, None, {"model": "m", "input": "x"}, "aembedding")
        assert unavailable.value.status_code == 503
        await handler.aclose()

    async def test_pass_forwards_it_and_says_so_once_per_type(
        self, litellm_callback: ModuleType, caplog: pytest.LogCaptureFixture
    ) -> None:
        handler = _handler(litellm_callback, unmetered="pass")
        data = {"model": "m", "input": "x"}
        before = _count(litellm_callback, "asearch", "pass")
        with caplog.at_level(logging.WARNING, logger=litellm_callback.__name__):
            for _ in range(3):
                assert await handler.async_pre_call_hook(KEY, None, dict(data), "asearch") == data
            await handler.async_pre_call_hook(KEY, None, dict(data), "aocr")
        said = [r.getMessage() for r in caplog.records if "passes unmetered" in r.getMessage()]
        assert len(said) == 2 and "'asearch'" in said[0] and "'aocr'" in said[1]
        # Passed, yet counted by type: never silently.
        assert _count(litellm_callback, "asearch", "pass") == before + 3
        await handler.aclose()

    async def test_count_is_the_default_and_admits_one_request(
        self, litellm_callback: ModuleType
    ) -> None:
        handler = _handler(litellm_callback)
        assert handler.settings.unmetered == "count"
        # Counting asks admission: unreachable here, so the call fails closed.
        with pytest.raises(litellm_callback.SpendgateRefusal) as refused:
            await handler.async_pre_call_hook(KEY, None, {"model": "m"}, "asearch")
        assert refused.value.status_code == 503
        await handler.aclose()

    async def test_calls_that_reach_no_model_are_free(self, litellm_callback: ModuleType) -> None:
        handler = _handler(litellm_callback, unmetered="reject")
        data = {"model": "m", "purpose": "batch"}
        assert await handler.async_pre_call_hook(KEY, None, dict(data), "acreate_file") == data
        assert await handler.async_pre_call_hook(KEY, None, dict(data), "aretrieve_batch") == data
        await handler.aclose()


class TestKinds:
    def test_the_hooks_call_types(self, calls: ModuleType) -> None:
        kinds = {
            t: calls.kind_of(t)
            for t in (
                "acompletion",
                "atext_completion",
                "aresponses",
                "anthropic_messages",
                "aembedding",
                "image_generation",
                "aspeech",
                "transcription",
                "rerank",
                "acreate_batch",
                "acreate_file",
                "moderation",
                "pass_through_endpoint",
            )
        }
        assert kinds == {
            "acompletion": "chat",
            "atext_completion": "text",
            "aresponses": "responses",
            "anthropic_messages": "messages",
            "aembedding": "embedding",
            "image_generation": "image",
            "aspeech": "speech",
            "transcription": "transcription",
            "rerank": "rerank",
            "acreate_batch": "batch",
            "acreate_file": "free",
            "moderation": "unknown",
            "pass_through_endpoint": "unknown",
        }

    def test_the_output_cap_of_each_kind(self, calls: ModuleType) -> None:
        data: dict[str, Any] = {}
        assert calls.set_max_output("responses", data, 7) == 16  # the API's minimum
        assert data == {"max_output_tokens": 16}
        data = {}
        calls.set_max_output("messages", data, 7)
        assert data == {"max_tokens": 7}
        assert calls.max_output("chat", {"max_tokens": 9, "max_completion_tokens": 5}) == 5
        assert calls.max_output("embedding", {"max_tokens": 9}) is None


class TestReported:
    def test_each_answer_shape(self, calls: ModuleType) -> None:
        chat = SimpleNamespace(
            usage=SimpleNamespace(
                prompt_tokens=40,
                completion_tokens=5,
                prompt_tokens_details=SimpleNamespace(cached_tokens=8),
            ),
            _hidden_params={"response_cost": 0.0000011},
        )
        assert calls.reported(chat) == Usage(
            requests=1, input_tokens=32, cached_input_tokens=8, output_tokens=5, cost_usd_micros=2
        )
        responses = {
            "usage": {
                "input_tokens": 40,
                "input_tokens_details": {"cached_tokens": 8},
                "output_tokens": 5,
            }
        }
        assert calls.reported(responses) == Usage(
            requests=1, input_tokens=32, cached_input_tokens=8, output_tokens=5
        )
        anthropic = {
            "usage": {"input_tokens": 32, "cache_read_input_tokens": 8, "output_tokens": 5}
        }
        assert calls.reported(anthropic) == calls.reported(responses)
        rerank = {"meta": {"tokens": {"input_tokens": 15, "output_tokens": 0}}}
        assert calls.reported(rerank, 0.002) == Usage(
            requests=1, input_tokens=15, cost_usd_micros=2000
        )
        assert calls.reported(SimpleNamespace()) is None

    def test_an_anthropic_stream_read_across_chunks(self, calls: ModuleType) -> None:
        sse = calls.SseUsage()
        start = (
            b'event: message_start\ndata: {"type": "message_start", "message": {"usage": '
            b'{"input_tokens": 32, "output_tokens": 1}}}\n\n'
        )
        sse.events(start)
        assert sse.reported() is None  # message_start's count is not the stream's
        sse = calls.SseUsage()
        raw = (
            b'event: message_start\ndata: {"type": "message_start", "message": {"usage": '
            b'{"input_tokens": 32, "cache_read_input_tokens": 8, "output_tokens": 1}}}\n\n'
            b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
            b'"delta": {"type": "text_delta", "text": " a"}}\n\n'
            b'event: message_delta\ndata: {"type": "message_delta", "delta": {}, '
            b'"usage": {"output_tokens": 2}}\n\n'
        )
        events = [e for i in range(0, len(raw), 7) for e in sse.events(raw[i : i + 7])]
        assert b"".join(piece for piece, _ in events) == raw and sse.pending == b""
        assert [text for _, text in events] == ["", " a", ""]
        assert sse.reported() == Usage(
            requests=1, input_tokens=32, cached_input_tokens=8, output_tokens=2
        )
