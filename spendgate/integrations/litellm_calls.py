"""What each LiteLLM call type is to spendgate: its estimate, its output cap, its usage.

Pure (no proxy, no I/O): the callback in :mod:`spendgate.integrations.litellm` asks here
what a request is, how much it may use, and what its provider reported. The call types
are the strings LiteLLM 1.108.0's proxy hands the pre-call hook and the success event
(``docs/litellm-call-types.md``); a string not named here is *unknown*, and the
``UNMETERED`` setting decides what happens to it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from spendgate.integrations.gateway import usage_of
from spendgate.schemas.events import Usage

__all__ = [
    "CALL_KINDS",
    "FREE_CALLS",
    "Kind",
    "SseUsage",
    "answer_cost",
    "chunk_text",
    "cost_of",
    "has_output",
    "input_text",
    "kind_of",
    "max_output",
    "one_request",
    "reported",
    "set_max_output",
    "streamed_usage",
]

#: How spendgate meters a call: the kinds below, ``free`` (no model is called) or
#: ``unknown`` (the ``UNMETERED`` setting decides).
Kind = Literal[
    "chat",
    "text",
    "responses",
    "messages",
    "embedding",
    "image",
    "speech",
    "transcription",
    "rerank",
    "batch",
    "free",
    "unknown",
]

#: The hook's call types (and the success event's, where they differ) by kind. Images,
#: transcription and rerank reach the hook under the sync name, the event under the async one.
CALL_KINDS: Mapping[str, Kind] = {
    "completion": "chat",
    "acompletion": "chat",
    "text_completion": "text",
    "atext_completion": "text",
    "responses": "responses",
    "aresponses": "responses",
    "anthropic_messages": "messages",
    "aanthropic_messages": "messages",
    "embedding": "embedding",
    "aembedding": "embedding",
    "image_generation": "image",
    "aimage_generation": "image",
    "image_edit": "image",
    "aimage_edit": "image",
    "speech": "speech",
    "aspeech": "speech",
    "transcription": "transcription",
    "atranscription": "transcription",
    "rerank": "rerank",
    "arerank": "rerank",
    "create_batch": "batch",
    "acreate_batch": "batch",
}

#: Calls that reach no model: files and batch lookups. Admitted without a charge (a
#: batch is charged when it is created; a file costs nothing until a batch reads it).
FREE_CALLS = frozenset(
    {
        "acreate_file",
        "afile_retrieve",
        "afile_delete",
        "afile_content",
        "afile_list",
        "aretrieve_batch",
        "alist_batches",
        "acancel_batch",
        # LiteLLM 1.108.0 hands GET /v1/files this name (files_endpoints.py:1741).
        "alist_fine_tuning_jobs",
    }
)

#: Where each kind's output cap lives in the request, and the lowest the provider takes.
_OUTPUT_KEYS: Mapping[Kind, tuple[str, ...]] = {
    "chat": ("max_tokens", "max_completion_tokens"),
    "text": ("max_tokens", "max_completion_tokens"),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
}
#: OpenAI's Responses API refuses a ``max_output_tokens`` below 16 (LiteLLM raises it).
_MIN_OUTPUT: Mapping[Kind, int] = {"responses": 16}


def kind_of(call_type: str) -> Kind:
    """The kind of a call type (``unknown`` for a string spendgate does not know)."""
    if call_type in FREE_CALLS:
        return "free"
    return CALL_KINDS.get(call_type, "unknown")


def max_output(kind: Kind, data: Mapping[str, Any]) -> int | None:
    """The output cap the request sets, or None (None too for kinds without output)."""
    found = [data.get(k) for k in _OUTPUT_KEYS.get(kind, ())]
    values = [v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(values) if values else None


def set_max_output(kind: Kind, data: dict[str, Any], tokens: int) -> int:
    """Set the request's output cap; returns the cap the provider will see."""
    tokens = max(tokens, _MIN_OUTPUT.get(kind, 1))
    for key in _OUTPUT_KEYS.get(kind, ()):
        data[key] = tokens
    return tokens


def has_output(kind: Kind) -> bool:
    """Whether the kind produces output tokens spendgate reserves (and caps)."""
    return kind in _OUTPUT_KEYS


def _texts(value: Any) -> Iterator[str]:
    """Every text in a request's content: strings, and the ``text``/``content`` of parts."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key in ("text", "content", "input", "instructions", "system", "query"):
            if key in value:
                yield from _texts(value[key])
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _texts(item)


def input_text(kind: Kind, data: Mapping[str, Any]) -> tuple[str, int]:
    """The request's input as text to count, and the tokens it gives as ids (embeddings
    of token arrays), for kinds other than chat (whose messages are counted as such)."""
    match kind:
        case "text":
            parts: list[Any] = [data.get("prompt")]
        case "responses":
            parts = [data.get("instructions"), data.get("input")]
        case "messages":
            parts = [data.get("system"), data.get("messages")]
        case "embedding":
            given = data.get("input")
            ids = 0
            if isinstance(given, list) and given and all(isinstance(x, int) for x in given):
                return "", len(given)
            if isinstance(given, list):
                ids = sum(len(x) for x in given if isinstance(x, list))
            return "\n".join(_texts(given)), ids
        case "image":
            parts = [data.get("prompt")]
        case "rerank":
            parts = [data.get("query"), data.get("documents")]
        case _:
            parts = []
    return "\n".join(t for p in parts for t in _texts(p)), 0


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def cost_of(value: Any) -> float | None:
    """A ``response_cost`` LiteLLM computed (dollars), or None when it priced nothing."""
    return float(value) if isinstance(value, int | float) and value > 0 else None


def answer_cost(response: Any) -> float | None:
    """The ``response_cost`` LiteLLM keeps in an answer's hidden params, if any."""
    hidden = _get(response, "_hidden_params")
    return cost_of(hidden.get("response_cost")) if isinstance(hidden, Mapping) else None


def _usage_of(usage: Any, cost: float | None) -> Usage | None:
    """A usage object of any of LiteLLM's shapes (chat, Responses, Anthropic, images)."""
    if usage is None:
        return None
    prompt = _get(usage, "prompt_tokens")
    if prompt is None:  # Responses, Anthropic and images say input/output
        anthropic = _int(_get(usage, "cache_read_input_tokens")) + _int(
            _get(usage, "cache_creation_input_tokens")
        )
        if _get(usage, "prompt_tokens_details") is None and anthropic:
            # Anthropic's input_tokens leave the cache reads and writes out.
            prompt = _int(_get(usage, "input_tokens")) + anthropic
            cached = _int(_get(usage, "cache_read_input_tokens"))
            return usage_of(prompt, _int(_get(usage, "output_tokens")), cached, cost)
        prompt = _get(usage, "input_tokens")
        output = _get(usage, "output_tokens")
        details = _get(usage, "input_tokens_details")
    else:
        output = _get(usage, "completion_tokens")
        details = _get(usage, "prompt_tokens_details")
    cached = _int(_get(details, "cached_tokens")) if details is not None else 0
    return usage_of(_int(prompt), _int(output), cached, cost)


def reported(response: Any, cost: float | None = None) -> Usage | None:
    """What a provider's answer reports, or None when it carries no usage.

    Args:
        response: a chat, completion, Responses, embeddings or images answer (object or
            dict), an Anthropic message (dict), or a rerank answer (``meta`` tokens).
        cost: LiteLLM's ``response_cost`` when the caller has it (else the answer's own).
    """
    if cost is None:
        cost = answer_cost(response)
    usage = _usage_of(_get(response, "usage"), cost)
    if usage is not None:
        return usage
    meta = _get(response, "meta")  # rerank
    if meta is not None:
        tokens = _get(meta, "tokens")
        billed = _get(meta, "billed_units")
        if tokens is not None:
            return usage_of(
                _int(_get(tokens, "input_tokens")), _int(_get(tokens, "output_tokens")), 0, cost
            )
        if billed is not None and _get(billed, "total_tokens") is not None:
            return usage_of(_int(_get(billed, "total_tokens")), 0, 0, cost)
    return None


def one_request(cost: float | None) -> Usage:
    """One request, at LiteLLM's cost when it priced it (rounded up to the micro-dollar)."""
    micros = None if cost is None or cost <= 0 else math.ceil(cost * 1_000_000)
    return Usage(requests=1, cost_usd_micros=micros)


# -- streams ---------------------------------------------------------------------------


@dataclass(slots=True)
class SseUsage:
    """What an Anthropic stream (raw SSE bytes, as the proxy passes ``/v1/messages``
    chunks) has said so far: text deltas, and the usage of ``message_start`` and
    ``message_delta``. Events may straddle chunks; they are read once whole."""

    pending: bytes = b""
    usage: dict[str, int] = field(default_factory=dict)
    #: ``message_delta`` came: the usage is the stream's final count.
    final: bool = False

    def events(self, chunk: bytes) -> list[tuple[bytes, str]]:
        """Read a chunk; returns each event it completed (its bytes, as passed on) with
        the text it adds. What is left of an event waits in :attr:`pending`."""
        self.pending += chunk
        *whole, self.pending = self.pending.split(b"\n\n")
        return [(raw + b"\n\n", self._read(raw)) for raw in whole]

    def _read(self, raw: bytes) -> str:
        text = []
        for line in raw.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            try:
                event = json.loads(line[5:].strip())
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "content_block_delta":
                delta = event.get("delta") or {}
                for key in ("text", "thinking", "partial_json"):
                    if isinstance(delta.get(key), str):
                        text.append(delta[key])
            elif kind == "message_start":
                self._merge((event.get("message") or {}).get("usage"))
            elif kind == "message_delta":
                self._merge(event.get("usage"))
                self.final = True
        return "".join(text)

    def _merge(self, usage: Any) -> None:
        if isinstance(usage, dict):
            for key, value in usage.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    self.usage[key] = value

    def reported(self) -> Usage | None:
        """The usage the stream reported, once its ``message_delta`` came."""
        if not self.final or "output_tokens" not in self.usage:
            return None
        return _usage_of(self.usage, None)


def chunk_text(kind: Kind, item: Any) -> str:
    """The output text of one chat or Responses stream chunk."""
    if kind == "responses":
        if _get(item, "type") == "response.output_text.delta":
            delta = _get(item, "delta")
            return delta if isinstance(delta, str) else ""
        return ""
    parts = []
    for choice in _get(item, "choices") or []:
        content = _get(_get(choice, "delta"), "content")
        if isinstance(content, str):
            parts.append(content)
    return "".join(parts)


def streamed_usage(kind: Kind, item: Any) -> Usage | None:
    """The usage a chat chunk or a Responses ``response.completed`` event reports."""
    if kind == "responses":
        if _get(item, "type") == "response.completed":
            return reported(_get(item, "response"))
        return None
    return reported(item)
