"""spendgate inside a LiteLLM proxy: admit before the call, settle after, extend streams.

Load it from the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: spendgate.integrations.litellm.handler

and configure it with ``SPENDGATE_LITELLM_*`` environment variables
(:class:`LiteLLMSettings`; read on the first request, not at import).

* **Before the call** each attempt is admitted on its own (request id = LiteLLM's call id):
  the estimate is the prompt's tokens (LiteLLM's counter) plus the output allowance,
  injected as ``max_tokens`` / ``max_completion_tokens`` when the request sets neither.
  ``cap`` lowers them, ``downgrade`` and ``route`` rewrite the model, ``delay`` waits in
  admission, ``reject`` answers 429 (:func:`spendgate.integrations.gateway.refusal_of`).
* **After success** the provider's usage is committed; **after a failure** the
  reservation is released. An SDK retry is a new call with a new id: the failed attempt's
  failure hook released its reservation, so a retried request is charged once.
* **Streams** reserve a first block of output and extend in blocks of ``stream_step``
  tokens; a refused extend ends the stream there. However a stream ends (completed,
  stopped, abandoned by its client, failed) what it produced is committed.
* **spendgate unreachable** (bounded by ``timeout_s`` and ``retries``): the strictest
  failure mode of the matching policies decides, read from the policies topic when
  ``kafka_bootstrap`` is set, else ``unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger
from prometheus_client import Counter
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from spendgate.admission.client import AsyncAdmissionClient, AsyncStream
from spendgate.admission.exceptions import (
    AdmissionRequestError,
    AdmissionUnavailable,
    BudgetExceeded,
)
from spendgate.admission.fallback import DegradedLedger, strictest
from spendgate.integrations.gateway import (
    Refusal,
    RequestView,
    check_mapping,
    estimate_of,
    refusal_of,
    subject_of,
    unavailable_refusal,
    usage_of,
)
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.exceptions import SpendgateError
from spendgate.schemas.key_settings import SubjectSecretSettings, announce

__all__ = ["LiteLLMSettings", "SpendgateLogger", "SpendgateRefusal", "handler"]

logger = logging.getLogger(__name__)

#: The LiteLLM call types spendgate admits; others (embeddings, images...) pass unmetered.
ENFORCED_CALLS = frozenset({"completion", "acompletion", "text_completion", "atext_completion"})

#: Calls remembered between their admit and their settle (older ones expire in spendgate).
MAX_OPEN_CALLS = 100_000

DECISIONS = Counter(
    "spendgate_litellm_decisions_total",
    "Proxy calls by what spendgate decided (allow, cap, downgrade, route, observe_reject, "
    "reject), or unavailable (admission unreachable: refused) and unmetered (passed).",
    ["decision"],
)
SETTLED = Counter(
    "spendgate_litellm_settled_total",
    "Reservations settled by the proxy: commit, release, or failed (left to expire).",
    ["outcome"],
)
STREAMS_STOPPED = Counter(
    "spendgate_litellm_streams_stopped_total", "Streams ended where an extend was refused."
)


class LiteLLMSettings(BaseSettings):
    """The LiteLLM callback's settings (``SPENDGATE_LITELLM_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_LITELLM_", frozen=True, extra="forbid")

    admission_url: str = "http://127.0.0.1:8787"
    #: The bearer token the proxy admits with (bound to the tenants it serves).
    token: SecretStr | None = None
    #: Per attempt to reach admission.
    timeout_s: float = Field(2.0, gt=0, le=30)
    retries: int = Field(1, ge=0, le=5)
    #: How long an admit may be held by a ``delay`` policy (its ``max_delay``); 0 when no
    #: policy delays. An admit never takes longer than :attr:`admit_deadline_s`.
    max_hold_s: float = Field(60.0, ge=0, le=60)
    #: The output reserved (and injected as max_tokens) when a request sets none.
    output_allowance: int = Field(1024, ge=1)
    #: A stream's first block and each extend, in output tokens.
    stream_step: int = Field(256, ge=1)
    #: Subject field -> source (``team_id``, ``key``, ``metadata.NAME``...; ``a|b``: the
    #: first present). ``key`` is the proxy's hash of the caller's key, never the key.
    subject: dict[str, str] = Field(
        default_factory=lambda: {
            "tenant": "team_id",
            "api_key": "key",
            "user": "user_id",
            "model": "model",
        }
    )
    #: The model group a ``route`` decision's pool maps to (default: the pool's name).
    route_models: dict[str, str] = Field(default_factory=dict)
    #: Above this wait a refusal tells clients not to retry (``x-should-retry: false``).
    max_retry_after_s: int = Field(60, ge=1, le=120)
    #: Kafka, to read the policies' failure modes for when admission is unreachable.
    kafka_bootstrap: str | None = None
    topic_prefix: str = "budget."
    #: The failure mode while admission is unreachable and no policy is known.
    unavailable: Literal["closed", "open"] = "closed"

    @property
    def admit_deadline_s(self) -> float:
        """The longest an admit takes before the failure mode decides instead."""
        return self.timeout_s * (self.retries + 1) + self.max_hold_s + 1.0


class SpendgateRefusal(Exception):
    """A refusal the proxy answers as an OpenAI error: ``status_code``, ``type``, ``headers``.

    The proxy keeps ``type`` and the headers and puts ``provider_specific_fields`` under
    the error object; it always sets ``code`` to the status.
    """

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.message = refusal.message
        self.status_code = refusal.status
        self.type = refusal.type
        self.code = refusal.type
        self.param = None
        self.headers = dict(refusal.headers)
        self.provider_specific_fields = {"spendgate": refusal.details}


@dataclass(slots=True)
class _Call:
    """One admitted call between its admit and its settle."""

    decision: Decision
    prompt_tokens: int
    stream: AsyncStream | None


def _max_output(data: Mapping[str, Any]) -> int | None:
    found = [data.get(k) for k in ("max_tokens", "max_completion_tokens")]
    values = [v for v in found if isinstance(v, int) and v > 0]
    return min(values) if values else None


def _set_max_output(data: dict[str, Any], tokens: int) -> None:
    data["max_tokens"] = tokens
    data["max_completion_tokens"] = tokens


def _prompt_tokens(data: Mapping[str, Any]) -> int:
    import litellm

    model = str(data.get("model") or "")
    try:
        if data.get("messages") is not None:
            return int(litellm.token_counter(model=model, messages=data["messages"]))
        prompt = data.get("prompt")
        if prompt is not None:
            return int(litellm.token_counter(model=model, text=prompt))
    except Exception:  # an unknown content shape: count characters instead
        logger.debug("token counting failed; estimating from characters", exc_info=True)
    return len(str(data.get("messages") or data.get("prompt") or "")) // 4 + 1


def _view(user_api_key_dict: Any, data: Mapping[str, Any]) -> RequestView:
    def attr(name: str) -> str | None:
        value = getattr(user_api_key_dict, name, None)
        return value if isinstance(value, str) and value else None

    metadata = data.get("metadata")
    return RequestView(
        key=attr("api_key") or attr("token"),
        key_alias=attr("key_alias"),
        team_id=attr("team_id"),
        team_alias=attr("team_alias"),
        user_id=attr("user_id"),
        end_user=attr("end_user_id") or data.get("user"),
        org_id=attr("org_id"),
        model=data.get("model"),
        metadata=metadata if isinstance(metadata, Mapping) else {},
    )


def _reported(response: Any) -> Usage | None:
    usage = getattr(response, "usage", None)
    if usage is None:
        return None
    details = getattr(usage, "prompt_tokens_details", None)
    cost = (getattr(response, "_hidden_params", None) or {}).get("response_cost")
    return usage_of(
        int(getattr(usage, "prompt_tokens", 0) or 0),
        int(getattr(usage, "completion_tokens", 0) or 0),
        int(getattr(details, "cached_tokens", 0) or 0),
        float(cost) if isinstance(cost, int | float) else None,
    )


def _chunk_text(item: Any) -> str:
    parts = []
    for choice in getattr(item, "choices", None) or []:
        delta = getattr(choice, "delta", None)
        content = getattr(delta, "content", None)
        if isinstance(content, str):
            parts.append(content)
    return "".join(parts)


class SpendgateLogger(CustomLogger):
    """The LiteLLM proxy callback (see the module docstring).

    Args:
        settings: read from the environment on the first request when not given.
    """

    def __init__(self, settings: LiteLLMSettings | None = None) -> None:
        super().__init__()
        self._settings = settings
        self._client: AsyncAdmissionClient | None = None
        self._calls: OrderedDict[str, _Call] = OrderedDict()
        self._ledger = DegradedLedger()
        self._book: Any = None
        self._book_task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def settings(self) -> LiteLLMSettings:
        if self._settings is None:
            self._settings = LiteLLMSettings()
        return self._settings

    def _admission(self) -> AsyncAdmissionClient:
        if self._client is None:
            s = self.settings
            check_mapping(s.subject)
            # The deployment's SPENDGATE_SUBJECT_SECRET(_FILE) and SPENDGATE_SECRET_FIELDS: the
            # proxy's keys leave it only as key ids, and the policies read are in that form.
            key_ids = SubjectSecretSettings().key_ids()
            announce(key_ids, logger)
            self._client = AsyncAdmissionClient(
                s.admission_url,
                s.token.get_secret_value() if s.token else None,
                timeout_s=s.timeout_s,
                retries=s.retries,
                backoff_s=0.05,
                max_backoff_s=0.5,
                key_ids=key_ids,
            )
            if s.kafka_bootstrap:
                from spendgate.streams.policybook import PolicyBook

                self._book = PolicyBook(
                    s.kafka_bootstrap, f"{s.topic_prefix}policies", key_ids=key_ids
                )
                self._book_task = asyncio.ensure_future(self._book.run())
        return self._client

    async def start(self) -> None:
        """Connect, and wait (up to 30 s) until the policies are read when Kafka is set.

        Optional: the first request does the same without waiting for the policies.
        """
        self._admission()
        if self._book is not None:
            await asyncio.wait_for(self._book.ready.wait(), timeout=30)

    async def aclose(self) -> None:
        """Close the admission client and stop reading policies."""
        if self._book_task is not None:
            self._book_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._book_task
        if self._client is not None:
            await self._client.aclose()

    def _remember(self, call_id: str, call: _Call) -> None:
        self._calls[call_id] = call
        while len(self._calls) > MAX_OPEN_CALLS:
            self._calls.popitem(last=False)

    # -- hooks -----------------------------------------------------------------------

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        """Admit the call (raises :class:`SpendgateRefusal` when refused)."""
        if call_type not in ENFORCED_CALLS:
            return data
        s = self.settings
        client = self._admission()
        call_id = str(data.get("litellm_call_id") or uuid.uuid4().hex)
        subject = subject_of(s.subject, _view(user_api_key_dict, data))
        ceiling = _max_output(data)
        if ceiling is None:
            ceiling = s.output_allowance
            _set_max_output(data, ceiling)
        streaming = bool(data.get("stream"))
        prompt = _prompt_tokens(data)
        estimate = estimate_of(prompt, min(s.stream_step, ceiling) if streaming else ceiling)
        try:
            decision = await asyncio.wait_for(
                client.admit(subject, estimate, request_id=call_id), s.admit_deadline_s
            )
        except BudgetExceeded as exc:
            DECISIONS.labels(decision="reject").inc()
            raise SpendgateRefusal(refusal_of(exc.decision, s.max_retry_after_s)) from None
        except AdmissionRequestError as exc:
            # The request as mapped cannot be decided (a policy groups by a field the
            # mapping leaves out...): say so, never forward it unmetered.
            status = exc.status if exc.status in (400, 422) else 503
            raise HTTPException(status, f"spendgate: {exc.message}") from None
        except (AdmissionUnavailable, TimeoutError) as exc:
            self._unreachable(subject, estimate, str(exc))
            return data
        DECISIONS.labels(decision=decision.decision).inc()
        self._apply(decision, data)
        capped = decision.max_output_tokens
        stream = None
        if streaming:
            first = estimate
            if capped is not None and capped < first.output_tokens:
                first = estimate_of(prompt, capped)
            step = Usage(output_tokens=s.stream_step)
            stream = AsyncStream(decision, first, step, client)
        self._remember(call_id, _Call(decision, prompt, stream))
        return data

    def _apply(self, decision: Decision, data: dict[str, Any]) -> None:
        """Rewrite the request as the decision says."""
        if decision.max_output_tokens is not None:
            _set_max_output(data, decision.max_output_tokens)
        if decision.decision == "downgrade" and decision.model:
            data["model"] = decision.model
        if decision.decision == "route" and decision.route_to:
            data["model"] = self.settings.route_models.get(decision.route_to, decision.route_to)

    def _unreachable(self, subject: Subject, estimate: Usage, why: str) -> None:
        """Admission cannot be reached: the policies' failure mode decides (raises when
        the request is refused)."""
        policies = dict(self._book.policies) if self._book is not None else None
        if not policies:
            if self.settings.unavailable == "closed":
                DECISIONS.labels(decision="unavailable").inc()
                raise SpendgateRefusal(unavailable_refusal(why))
            DECISIONS.labels(decision="unmetered").inc()
            logger.warning("spendgate unreachable (%s): call passed unmetered", why)
            return
        from spendgate.admission.decide import Planner, fallback_answer

        keys = self._admission().key_ids
        if keys is not None:  # the policies read are in key-id form
            subject = keys.subject(subject)
        try:
            charges = Planner(list(policies.values()), None).charges(subject, estimate)
        except SpendgateError as exc:  # a policy the fallback cannot count: fail closed
            DECISIONS.labels(decision="unavailable").inc()
            raise SpendgateRefusal(unavailable_refusal(f"{why}; {exc}")) from None
        mode = strictest([c.target.policy for c in charges])
        if mode == "closed":
            DECISIONS.labels(decision="unavailable").inc()
            raise SpendgateRefusal(unavailable_refusal(why))
        now_ms = int(time.time() * 1000)
        outcome = fallback_answer(self._ledger, charges, subject.model, now_ms, "", 0)
        if outcome.answer is not None and outcome.answer.status == 429:
            DECISIONS.labels(decision="reject").inc()
            decision = Decision.model_validate(outcome.answer.body)
            raise SpendgateRefusal(refusal_of(decision, self.settings.max_retry_after_s))
        DECISIONS.labels(decision="unmetered").inc()
        logger.warning("spendgate unreachable (%s): call passed (failure mode %s)", why, mode)

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> Any:
        """Commit what the provider reported (a stream settles when it ends)."""
        call = self._calls.get(str(data.get("litellm_call_id")))
        if call is None or call.stream is not None:
            return response
        await self._settle(str(data.get("litellm_call_id")), _reported(response))
        return response

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        """Release the reservation of a call that failed before producing anything."""
        call_id = str(request_data.get("litellm_call_id"))
        call = self._calls.get(call_id)
        if call is None or (call.stream is not None and call.stream.usage is not None):
            return  # refused here, or a stream that settles what it produced
        await self._settle(call_id, None)

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """Pass chunks on while they fit the reservation, extending it in blocks."""
        import litellm

        call_id = str(request_data.get("litellm_call_id"))
        call = self._calls.get(call_id)
        if call is None or call.stream is None:
            async for item in response:
                yield item
            return
        stream, model = call.stream, str(request_data.get("model") or "")
        produced = 0
        reported: Usage | None = None
        try:
            async for item in response:
                reported = _reported(item) or reported
                text = _chunk_text(item)
                tokens = int(litellm.token_counter(model=model, text=text)) if text else 0
                if tokens:
                    usage = estimate_of(call.prompt_tokens, produced + tokens)
                    if not await stream.report(usage):
                        STREAMS_STOPPED.inc()
                        logger.info("stream %s stopped: %s", call_id, stream.refusal)
                        break
                    produced += tokens
                elif stream.usage is None:
                    stream.usage = estimate_of(call.prompt_tokens, 0)
                yield item
        finally:
            used = reported or estimate_of(call.prompt_tokens, produced)
            # Scheduled first: a client that went away cancels this generator, not the
            # commit; then the provider's stream is closed (it may still be running).
            settling = asyncio.ensure_future(self._settle(call_id, used))
            try:
                closing = getattr(response, "aclose", None)
                if closing is not None:
                    with contextlib.suppress(Exception):
                        await closing()
            finally:
                await asyncio.shield(settling)

    # -- settle ----------------------------------------------------------------------

    async def _settle(self, call_id: str, usage: Usage | None) -> None:
        call = self._calls.pop(call_id, None)  # popped: each call settles once
        if call is None:
            return
        rid = call.decision.reservation_id
        if rid is None:
            return
        client = self._admission()
        try:
            if usage is not None and usage != Usage():
                await client.commit(rid, usage)
                SETTLED.labels(outcome="commit").inc()
            else:
                await client.release(rid)
                SETTLED.labels(outcome="release").inc()
        except Exception:  # never fail the caller's answer; the reservation expires
            SETTLED.labels(outcome="failed").inc()
            logger.exception("settling reservation %s of call %s failed", rid, call_id)


#: The instance ``config.yaml`` names (``callbacks: spendgate.integrations.litellm.handler``).
handler = SpendgateLogger()
