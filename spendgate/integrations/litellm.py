"""spendgate inside a LiteLLM proxy: admit before the call, settle after, extend streams.

Load it from the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: spendgate.integrations.litellm.handler

and configure it with ``SPENDGATE_LITELLM_*`` environment variables
(:class:`LiteLLMSettings`; read on the first request, not at import).

* **Every call type** is metered (:mod:`spendgate.integrations.litellm_calls` says how):
  chat and text completions, the Responses API, Anthropic's ``/v1/messages``, embeddings,
  images, speech, transcription, rerank and batch creation. A call type spendgate does not
  know is counted as one request (``unmetered``: ``count``), refused (``reject``) or
  passed (``pass``, logged once per type); never silently free.
* **Before the call** each attempt is admitted on its own (request id = LiteLLM's call id):
  the estimate is the prompt's tokens (LiteLLM's counter) plus the output allowance,
  injected as the request's output cap (``max_tokens`` / ``max_completion_tokens``,
  ``max_output_tokens`` on the Responses API) when the request sets none.
  ``cap`` lowers them, ``downgrade`` and ``route`` rewrite the model, ``delay`` waits in
  admission, ``reject`` answers 429 (:func:`spendgate.integrations.gateway.refusal_of`).
* **After success** the provider's usage is committed (chat and text completions from
  the answer, the other types from LiteLLM's success event, with its cost); **after a
  failure** the reservation is released. An SDK retry is a new call with a new id: the
  failed attempt's failure hook released its reservation, so a retried request is
  charged once.
* **Batches**: a submission is one request; a finished batch's tokens and cost are
  committed once, when a retrieval through the proxy reports them.
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
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import HTTPException
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException
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
)
from spendgate.integrations.litellm_calls import (
    Kind,
    SseUsage,
    answer_cost,
    chunk_text,
    cost_of,
    has_output,
    input_text,
    kind_of,
    max_output,
    one_request,
    reported,
    set_max_output,
    streamed_usage,
)
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.exceptions import SpendgateError
from spendgate.schemas.key_settings import SubjectSecretSettings, announce

__all__ = ["LiteLLMSettings", "SpendgateLogger", "SpendgateRefusal", "handler"]

logger = logging.getLogger(__name__)

#: The kinds whose answers stream (and extend their reservation as they do).
STREAMING_KINDS: frozenset[Kind] = frozenset({"chat", "text", "responses", "messages"})
#: The kinds settled from the answer the proxy hands ``async_post_call_success_hook``;
#: the others from the success event (which carries LiteLLM's cost, and fires on the
#: routes without that hook: speech, transcription, rerank).
ANSWER_SETTLED: frozenset[Kind] = frozenset({"chat", "text", "batch", "unknown"})
#: A batch status whose usage LiteLLM reports as final.
BATCH_FINAL = frozenset({"completed", "complete", "failed", "cancelled", "expired"})

#: Calls remembered between their admit and their settle (older ones expire in spendgate).
MAX_OPEN_CALLS = 100_000

DECISIONS = Counter(
    "spendgate_litellm_decisions_total",
    "Proxy calls by what spendgate decided (allow, cap, downgrade, route, observe_reject, "
    "reject), or unavailable (admission unreachable: refused) and unmetered (passed), "
    "by LiteLLM call type.",
    ["decision", "call_type"],
)
SETTLED = Counter(
    "spendgate_litellm_settled_total",
    "Reservations settled by the proxy: commit, release, or failed (left to expire), by "
    "LiteLLM call type.",
    ["outcome", "call_type"],
)
UNMETERED = Counter(
    "spendgate_litellm_unmetered_total",
    "Calls of a type spendgate does not know, by call type and what the unmetered "
    "setting did with them (count, reject, pass).",
    ["call_type", "mode"],
)
STREAMS_STOPPED = Counter(
    "spendgate_litellm_streams_stopped_total", "Streams ended where an extend was refused."
)


class LiteLLMSettings(BaseSettings):
    """The LiteLLM callback's settings (``SPENDGATE_LITELLM_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_LITELLM_", frozen=True, extra="forbid")

    admission_url: str = Field(
        "http://127.0.0.1:8787", description="The admission service the proxy admits through."
    )
    token: SecretStr | None = Field(
        None,
        description="The bearer token the proxy admits with (bound to the tenants it serves).",
    )
    timeout_s: float = Field(
        2.0, gt=0, le=30, description="Per attempt to reach admission, in seconds."
    )
    retries: int = Field(
        1, ge=0, le=5, description="Retries after a failed attempt to reach admission."
    )
    max_hold_s: float = Field(
        60.0,
        ge=0,
        le=60,
        description="How long an admit may be held by a `delay` policy (its `max_delay`); 0 "
        "when no policy delays. An admit never takes longer than `TIMEOUT_S` x (`RETRIES` + "
        "1) + `MAX_HOLD_S` + 1 s.",
    )
    output_allowance: int = Field(
        1024,
        ge=1,
        description="The output reserved, and injected as `max_tokens` and "
        "`max_completion_tokens`, when a request sets neither.",
    )
    stream_step: int = Field(
        256, ge=1, description="A stream's first block and each extend, in output tokens."
    )
    subject: dict[str, str] = Field(
        default_factory=lambda: {
            "tenant": "team_id",
            "api_key": "key",
            "user": "user_id",
            "model": "model",
        },
        description="JSON: subject field -> source (`team_id`, `key`, `metadata.NAME`...; "
        "`a|b`: the first present). `key` is the proxy's hash of the caller's key, never the "
        "key.",
    )
    route_models: dict[str, str] = Field(
        default_factory=dict,
        description="JSON: the model group a `route` decision's pool maps to (default: the "
        "pool's name).",
    )
    max_retry_after_s: int = Field(
        60,
        ge=1,
        le=120,
        description="Above this wait a refusal tells clients not to retry "
        "(`x-should-retry: false`).",
    )
    kafka_bootstrap: str | None = Field(
        None,
        description="Kafka, to read the policies' failure modes for when admission is "
        "unreachable (none: `UNAVAILABLE` decides).",
    )
    topic_prefix: str = Field(
        "budget.", description="The deployment's topic prefix (its policies topic is read)."
    )
    unavailable: Literal["closed", "open"] = Field(
        "closed",
        description="The failure mode while admission is unreachable and no policy is known.",
    )
    unmetered: Literal["count", "reject", "pass"] = Field(
        "count",
        description="A call type spendgate does not know: `count` admits and commits it as "
        "one request, `reject` refuses it (403), `pass` forwards it unmetered (logged once "
        "per type).",
    )

    @property
    def admit_deadline_s(self) -> float:
        """The longest an admit takes before the failure mode decides instead."""
        return self.timeout_s * (self.retries + 1) + self.max_hold_s + 1.0


class SpendgateRefusal(ProxyException):
    """A refusal the proxy answers in its route's error shape, with ``status_code``,
    ``type``, ``headers`` and ``provider_specific_fields``.

    A :class:`ProxyException` because only those keep their headers (``Retry-After``,
    ``x-should-retry``) on ``/v1/messages``, where the proxy answers Anthropic's shape
    (``{"type": "error", "error": {"type": "rate_limit_error", ...}}``, the type from the
    status); OpenAI routes answer OpenAI's, keeping ``type``, with ``code`` the status.
    """

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(
            message=refusal.message,
            type=refusal.type,
            param=None,
            code=refusal.status,
            headers=dict(refusal.headers),
            provider_specific_fields={"spendgate": refusal.details},
        )
        #: Read by the routes that rebuild the error (transcription answers 500 without).
        self.status_code = refusal.status


def unmetered_refusal(call_type: str) -> Refusal:
    """The refusal of a call type spendgate does not meter, under ``unmetered: reject``."""
    return Refusal(
        403,
        "unmetered_call_type",
        f"spendgate does not meter LiteLLM call type {call_type!r}, and this proxy refuses "
        "unmetered calls (SPENDGATE_LITELLM_UNMETERED=reject).",
        {"x-should-retry": "false"},
        {"call_type": call_type, "reason": "unmetered_call_type"},
    )


@dataclass(slots=True)
class _Call:
    """One admitted call between its admit and its settle."""

    decision: Decision
    prompt_tokens: int
    stream: AsyncStream | None
    kind: Kind = "chat"
    call_type: str = "acompletion"
    subject: Subject | None = None


def _count(model: str, text: str) -> int:
    import litellm

    try:
        return int(litellm.token_counter(model=model, text=text)) if text else 0
    except Exception:  # an unknown model or text: count characters instead
        logger.debug("token counting failed; estimating from characters", exc_info=True)
        return len(text) // 4 + 1


def _prompt_tokens(kind: Kind, data: Mapping[str, Any]) -> int:
    import litellm

    model = str(data.get("model") or "")
    if kind == "chat" and data.get("messages") is not None:
        try:
            return int(litellm.token_counter(model=model, messages=data["messages"]))
        except Exception:  # an unknown content shape: count characters instead
            logger.debug("token counting failed; estimating from characters", exc_info=True)
            return len(str(data["messages"])) // 4 + 1
    text, ids = input_text(kind, data)
    return _count(model, text) + ids


def _estimate(kind: Kind, prompt: int, output: int) -> Usage:
    """The admit's estimate: output kinds reserve their output, embeddings their input;
    images, audio, rerank, batches and unknown calls one request, and one micro-dollar
    (no token price applies to them: a dollar budget admits them while it has room left,
    and the settle charges LiteLLM's cost)."""
    if has_output(kind):
        return estimate_of(prompt, output)
    if kind == "embedding":
        return estimate_of(prompt, 0)
    return Usage(requests=1, cost_usd_micros=1)


def _keep(remembered: OrderedDict[str, Any], key: str, value: Any) -> None:
    """Remember ``key``, forgetting the oldest entries beyond :data:`MAX_OPEN_CALLS`."""
    remembered[key] = value
    while len(remembered) > MAX_OPEN_CALLS:
        remembered.popitem(last=False)


def _call_id(data: Mapping[str, Any]) -> str | None:
    """LiteLLM's call id (pass-through routes keep it on the logging object only)."""
    found = data.get("litellm_call_id") or getattr(
        data.get("litellm_logging_obj"), "litellm_call_id", None
    )
    return str(found) if found else None


def _event_view(kwargs: Mapping[str, Any], batch: Any) -> RequestView:
    """Who a success event's call was for, from the metadata LiteLLM logs with it (the
    key that made the call), and the batch's own metadata for ``metadata.NAME``."""
    params = kwargs.get("litellm_params")
    found = params.get("metadata") if isinstance(params, Mapping) else None
    meta: Mapping[str, Any] = found if isinstance(found, Mapping) else {}

    def get(name: str) -> str | None:
        value = meta.get(name)
        return value if isinstance(value, str) and value else None

    own = getattr(batch, "metadata", None)
    return RequestView(
        key=get("user_api_key_hash"),
        key_alias=get("user_api_key_alias"),
        team_id=get("user_api_key_team_id"),
        team_alias=get("user_api_key_team_alias"),
        user_id=get("user_api_key_user_id"),
        end_user=get("user_api_key_end_user_id"),
        org_id=get("user_api_key_org_id"),
        metadata=own if isinstance(own, Mapping) else {},
    )


def _metadata(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The caller's metadata: ``metadata`` (a JSON string, or ``metadata[NAME]`` fields,
    on multipart routes such as transcription), else the copy LiteLLM keeps under
    ``litellm_metadata`` (Responses, ``/v1/messages``)."""
    found = data.get("metadata")
    if isinstance(found, str):
        with contextlib.suppress(ValueError):
            found = json.loads(found)
    # The form fields the SDKs send a multipart request's metadata as; the proxy leaves
    # them apart from the metadata it makes itself.
    fields = {
        k[len("metadata[") : -1]: v
        for k, v in data.items()
        if isinstance(k, str) and k.startswith("metadata[") and k.endswith("]")
    }
    if isinstance(found, Mapping):
        return {**fields, **found} if fields else found
    if fields:
        return fields
    kept = data.get("litellm_metadata")
    requester = kept.get("requester_metadata") if isinstance(kept, Mapping) else None
    return requester if isinstance(requester, Mapping) else {}


def _view(user_api_key_dict: Any, data: Mapping[str, Any]) -> RequestView:
    def attr(name: str) -> str | None:
        value = getattr(user_api_key_dict, name, None)
        return value if isinstance(value, str) and value else None

    return RequestView(
        key=attr("api_key") or attr("token"),
        key_alias=attr("key_alias"),
        team_id=attr("team_id"),
        team_alias=attr("team_alias"),
        user_id=attr("user_id"),
        end_user=attr("end_user_id") or data.get("user"),
        org_id=attr("org_id"),
        model=data.get("model"),
        metadata=_metadata(data),
    )


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
        self._passed: set[str] = set()
        #: Batch id -> the subject that submitted it, and the batches whose usage was
        #: committed (a completed batch is retrieved, and reported, on every poll).
        self._batch_subjects: OrderedDict[str, Subject] = OrderedDict()
        self._batches_done: OrderedDict[str, None] = OrderedDict()

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
                from spendgate.schemas.kafka_connect import KafkaSettings
                from spendgate.streams.policybook import PolicyBook

                # Security and replication from SPENDGATE_KAFKA_*, like every service's.
                kafka = KafkaSettings(kafka_bootstrap=s.kafka_bootstrap).kafka()
                self._book = PolicyBook(kafka, f"{s.topic_prefix}policies", key_ids=key_ids)
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
        _keep(self._calls, call_id, call)

    # -- hooks -----------------------------------------------------------------------

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        """Admit the call (raises :class:`SpendgateRefusal` when refused)."""
        kind = kind_of(call_type)
        if kind == "free" or (kind == "unknown" and not self._unknown(call_type)):
            return data
        s = self.settings
        client = self._admission()
        call_id = _call_id(data) or uuid.uuid4().hex
        subject = subject_of(s.subject, _view(user_api_key_dict, data))
        ceiling = 0
        if has_output(kind):
            found = max_output(kind, data)
            ceiling = found if found is not None else set_max_output(kind, data, s.output_allowance)
        streaming = bool(data.get("stream")) and kind in STREAMING_KINDS
        prompt = _prompt_tokens(kind, data) if kind != "unknown" else 0
        estimate = _estimate(kind, prompt, min(s.stream_step, ceiling) if streaming else ceiling)
        try:
            decision = await asyncio.wait_for(
                client.admit(subject, estimate, request_id=call_id), s.admit_deadline_s
            )
        except BudgetExceeded as exc:
            DECISIONS.labels(decision="reject", call_type=call_type).inc()
            raise SpendgateRefusal(refusal_of(exc.decision, s.max_retry_after_s)) from None
        except AdmissionRequestError as exc:
            # The request as mapped cannot be decided (a policy groups by a field the
            # mapping leaves out...): say so, never forward it unmetered.
            status = exc.status if exc.status in (400, 422) else 503
            raise HTTPException(status, f"spendgate: {exc.message}") from None
        except (AdmissionUnavailable, TimeoutError) as exc:
            self._unreachable(subject, estimate, str(exc), call_type)
            return data
        DECISIONS.labels(decision=decision.decision, call_type=call_type).inc()
        self._apply(kind, decision, data)
        capped = decision.max_output_tokens
        stream = None
        if streaming:
            first = estimate
            if capped is not None and capped < first.output_tokens:
                first = estimate_of(prompt, capped)
            step = Usage(output_tokens=s.stream_step)
            stream = AsyncStream(decision, first, step, client)
        self._remember(call_id, _Call(decision, prompt, stream, kind, call_type, subject))
        return data

    def _unknown(self, call_type: str) -> bool:
        """Whether a call type spendgate does not know is admitted (``count``); raises
        under ``reject``; False under ``pass`` (logged the first time a type passes)."""
        mode = self.settings.unmetered
        UNMETERED.labels(call_type=call_type, mode=mode).inc()
        if mode == "reject":
            DECISIONS.labels(decision="reject", call_type=call_type).inc()
            raise SpendgateRefusal(unmetered_refusal(call_type))
        if mode == "pass":
            DECISIONS.labels(decision="unmetered", call_type=call_type).inc()
            if call_type not in self._passed:
                self._passed.add(call_type)
                logger.warning(
                    "LiteLLM call type %r passes unmetered (SPENDGATE_LITELLM_UNMETERED=pass)",
                    call_type,
                )
            return False
        return True

    def _apply(self, kind: Kind, decision: Decision, data: dict[str, Any]) -> None:
        """Rewrite the request as the decision says."""
        if decision.max_output_tokens is not None and has_output(kind):
            set_max_output(kind, data, decision.max_output_tokens)
        if decision.decision == "downgrade" and decision.model:
            data["model"] = decision.model
        if decision.decision == "route" and decision.route_to:
            data["model"] = self.settings.route_models.get(decision.route_to, decision.route_to)

    def _unreachable(self, subject: Subject, estimate: Usage, why: str, call_type: str) -> None:
        """Admission cannot be reached: the policies' failure mode decides (raises when
        the request is refused)."""
        policies = dict(self._book.policies) if self._book is not None else None
        if not policies:
            if self.settings.unavailable == "closed":
                DECISIONS.labels(decision="unavailable", call_type=call_type).inc()
                raise SpendgateRefusal(unavailable_refusal(why))
            DECISIONS.labels(decision="unmetered", call_type=call_type).inc()
            logger.warning("spendgate unreachable (%s): call passed unmetered", why)
            return
        from spendgate.admission.decide import Planner, fallback_answer

        keys = self._admission().key_ids
        if keys is not None:  # the policies read are in key-id form
            subject = keys.subject(subject)
        try:
            charges = Planner(list(policies.values()), None).charges(subject, estimate)
        except SpendgateError as exc:  # a policy the fallback cannot count: fail closed
            DECISIONS.labels(decision="unavailable", call_type=call_type).inc()
            raise SpendgateRefusal(unavailable_refusal(f"{why}; {exc}")) from None
        mode = strictest([c.target.policy for c in charges])
        if mode == "closed":
            DECISIONS.labels(decision="unavailable", call_type=call_type).inc()
            raise SpendgateRefusal(unavailable_refusal(why))
        now_ms = int(time.time() * 1000)
        outcome = fallback_answer(self._ledger, charges, subject.model, now_ms, "", 0)
        if outcome.answer is not None and outcome.answer.status == 429:
            DECISIONS.labels(decision="reject", call_type=call_type).inc()
            decision = Decision.model_validate(outcome.answer.body)
            raise SpendgateRefusal(refusal_of(decision, self.settings.max_retry_after_s))
        DECISIONS.labels(decision="unmetered", call_type=call_type).inc()
        logger.warning("spendgate unreachable (%s): call passed (failure mode %s)", why, mode)

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> Any:
        """Commit what the provider reported (a stream settles when it ends; the kinds
        outside :data:`ANSWER_SETTLED` on the success event)."""
        call_id = str(_call_id(data))
        call = self._calls.get(call_id)
        if call is None or call.stream is not None or call.kind not in ANSWER_SETTLED:
            return response
        if call.kind in ("chat", "text"):
            await self._settle(call_id, reported(response))
        else:  # a batch, or an unknown call: one request
            self._submitted(call, response)
            await self._settle(call_id, one_request(answer_cost(response)))
        return response

    async def async_log_success_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        """Commit what a call the answer hook does not settle used, at LiteLLM's cost; and
        a completed batch's usage, the first time a retrieval reports it."""
        if kwargs.get("call_type") == "aretrieve_batch":
            await self._batch_usage(kwargs, response_obj)
            return
        call_id = str(kwargs.get("litellm_call_id"))
        call = self._calls.get(call_id)
        if call is None or call.stream is not None or call.kind in ("chat", "text"):
            return
        cost = cost_of(kwargs.get("response_cost"))
        usage = None
        if call.kind not in ("speech", "batch", "unknown"):
            usage = reported(response_obj, cost)
        self._submitted(call, response_obj)
        await self._settle(call_id, usage or one_request(cost))

    def _submitted(self, call: _Call, response: Any) -> None:
        """Remember who submitted a batch, to charge its usage to them."""
        batch_id = getattr(response, "id", None)
        if call.kind == "batch" and call.subject is not None and isinstance(batch_id, str):
            _keep(self._batch_subjects, batch_id, call.subject)

    async def _batch_usage(self, kwargs: Mapping[str, Any], batch: Any) -> None:
        """Commit a finished batch's tokens and cost (LiteLLM computes them from its output
        file on a retrieval), once: admitted with an empty estimate under the request id
        ``batch-<id>`` (admission repeats the first answer), then committed as an overage.
        The submission was the batch's request; this adds none."""
        batch_id = getattr(batch, "id", None)
        if not isinstance(batch_id, str) or getattr(batch, "usage", None) is None:
            return
        if getattr(batch, "status", None) not in BATCH_FINAL or batch_id in self._batches_done:
            return
        cost = cost_of(kwargs.get("response_cost")) or answer_cost(batch)
        used = reported(batch, cost)
        if used is None:
            return
        used = used.model_copy(update={"requests": 0})
        subject = self._batch_subjects.get(batch_id) or subject_of(
            self.settings.subject, _event_view(kwargs, batch)
        )
        _keep(self._batches_done, batch_id, None)
        client = self._admission()
        try:
            # Empty, with a cost of its own: nothing to price (the commit brings the cost).
            empty = Usage(cost_usd_micros=0)
            decision = await client.admit(subject, empty, request_id=f"batch-{batch_id}")
            if decision.reservation_id is not None and used != Usage():
                await client.commit(decision.reservation_id, used)
            SETTLED.labels(outcome="commit", call_type="aretrieve_batch").inc()
        except BudgetExceeded:
            # Already spent, and nowhere to put it: said, never silent.
            SETTLED.labels(outcome="refused", call_type="aretrieve_batch").inc()
            logger.warning("batch %s: its usage %s was refused by its budgets", batch_id, used)
        except Exception:  # a later retrieval tries again
            del self._batches_done[batch_id]
            SETTLED.labels(outcome="failed", call_type="aretrieve_batch").inc()
            logger.exception("committing the usage of batch %s failed", batch_id)

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: str | None = None,
    ) -> None:
        """Release the reservation of a call that failed before producing anything."""
        call_id = str(_call_id(request_data))
        call = self._calls.get(call_id)
        if call is None or (call.stream is not None and call.stream.usage is not None):
            return  # refused here, or a stream that settles what it produced
        await self._settle(call_id, None)

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """Pass chunks on while they fit the reservation, extending it in blocks."""
        call_id = str(_call_id(request_data))
        call = self._calls.get(call_id)
        if call is None or call.stream is None:
            async for item in response:
                yield item
            return
        stream, model = call.stream, str(request_data.get("model") or "")
        # /v1/messages streams arrive as the raw SSE bytes of Anthropic's events.
        sse = SseUsage() if call.kind == "messages" else None
        produced = 0
        said: Usage | None = None
        try:
            async for item in response:
                if sse is not None:  # passed on event by event, so a stop is exact
                    raw = item if isinstance(item, bytes) else str(item).encode()
                    pieces = sse.events(raw)
                    said = sse.reported() or said
                else:
                    pieces = [(item, chunk_text(call.kind, item))]
                    said = streamed_usage(call.kind, item) or said
                stopped = False
                for piece, text in pieces:
                    tokens = _count(model, text)
                    if tokens:
                        usage = estimate_of(call.prompt_tokens, produced + tokens)
                        if not await stream.report(usage):
                            STREAMS_STOPPED.inc()
                            logger.info("stream %s stopped: %s", call_id, stream.refusal)
                            stopped = True
                            break
                        produced += tokens
                    elif stream.usage is None:
                        stream.usage = estimate_of(call.prompt_tokens, 0)
                    yield piece
                if stopped:
                    break
            else:
                if sse is not None and sse.pending:  # an unterminated last event
                    yield sse.pending
        finally:
            used = said or estimate_of(call.prompt_tokens, produced)
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
                SETTLED.labels(outcome="commit", call_type=call.call_type).inc()
            else:
                await client.release(rid)
                SETTLED.labels(outcome="release", call_type=call.call_type).inc()
        except Exception:  # never fail the caller's answer; the reservation expires
            SETTLED.labels(outcome="failed", call_type=call.call_type).inc()
            logger.exception("settling reservation %s of call %s failed", rid, call_id)


#: The instance ``config.yaml`` names (``callbacks: spendgate.integrations.litellm.handler``).
handler = SpendgateLogger()
