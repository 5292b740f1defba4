"""What a gateway in front of the models does with spendgate, apart from any gateway's API.

A gateway hook (LiteLLM's callback today, an Envoy ``ext_proc`` filter one day) turns its
request into a subject and an estimate, a refusal into what its clients handle, and a
provider's usage into a commit. That part is here, pure: no gateway, no HTTP, no clock.
Streams extend through :class:`spendgate.admission.client.AsyncStream`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject, Usage

__all__ = [
    "SUBJECT_SOURCES",
    "Refusal",
    "RequestView",
    "check_mapping",
    "estimate_of",
    "refusal_of",
    "subject_of",
    "unavailable_refusal",
    "usage_of",
]

#: Where a subject field may come from (``metadata.NAME`` reads the request's metadata).
SUBJECT_SOURCES = (
    "key",
    "key_alias",
    "team_id",
    "team_alias",
    "user_id",
    "end_user",
    "org_id",
    "model",
)

#: The longest Retry-After a client is told to wait and retry: the OpenAI SDK for Python
#: honours up to 120 s, SDKs generated from the same layer elsewhere only 60 s.
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class RequestView:
    """Who a gateway request is for, as the gateway authenticated it.

    Attributes:
        key: the caller's key as the gateway stores it (LiteLLM: its hash), never raw.
        metadata: the request's own metadata (``metadata.NAME`` sources).
    """

    key: str | None = None
    key_alias: str | None = None
    team_id: str | None = None
    team_alias: str | None = None
    user_id: str | None = None
    end_user: str | None = None
    org_id: str | None = None
    model: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def source(self, name: str) -> str | None:
        """The value of one source (``team_id``, ``metadata.tenant``...); None when absent."""
        if name.startswith("metadata."):
            found = self.metadata.get(name.removeprefix("metadata."))
        elif name in SUBJECT_SOURCES:
            found = getattr(self, name)
        else:
            raise ValueError(
                f"unknown subject source {name!r}: use one of {', '.join(SUBJECT_SOURCES)} "
                "or metadata.NAME"
            )
        if found is None or found == "":
            return None
        return str(found)[:200]


def check_mapping(mapping: Mapping[str, str]) -> None:
    """Refuse a mapping naming an unknown subject field or source (at startup, not per call).

    Raises:
        ValueError: names the field or source to fix.
    """
    fields = set(Subject.model_fields) - {"labels"}
    empty = RequestView()
    for target, sources in mapping.items():
        if target not in fields and not target.startswith("labels."):
            raise ValueError(
                f"unknown subject field {target!r}: use one of {', '.join(sorted(fields))} "
                "or labels.NAME"
            )
        for name in sources.split("|"):
            empty.source(name.strip())


def subject_of(mapping: Mapping[str, str], view: RequestView) -> Subject:
    """The subject of a request: each field from the first of its sources that is present.

    ``mapping`` maps a subject field (``tenant``, ``labels.region``...) to its sources,
    alternatives separated by ``|`` (``team_id|key_alias``). Fields whose sources are all
    absent are left out.
    """
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for target, sources in mapping.items():
        value = next(
            (v for s in sources.split("|") if (v := view.source(s.strip())) is not None), None
        )
        if value is None:
            continue
        if target.startswith("labels."):
            labels[target.removeprefix("labels.")] = value
        else:
            values[target] = value
    return Subject(**values, labels=labels)


def estimate_of(prompt_tokens: int, output_tokens: int) -> Usage:
    """The estimate of one request: its prompt and the output it may produce."""
    return Usage(requests=1, input_tokens=max(0, prompt_tokens), output_tokens=output_tokens)


def usage_of(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    cost_usd: float | None = None,
) -> Usage:
    """What a provider reported, as spendgate counts it.

    OpenAI's ``prompt_tokens`` include the cached ones; spendgate counts them apart
    (``input_tokens`` excludes ``cached_input_tokens``). A cost is rounded up to the
    micro-dollar, so a charge is never lower than the provider's.
    """
    cached = max(0, min(cached_tokens, prompt_tokens))
    cost = None if cost_usd is None or cost_usd <= 0 else math.ceil(cost_usd * 1_000_000)
    return Usage(
        requests=1,
        input_tokens=max(0, prompt_tokens - cached),
        cached_input_tokens=cached,
        output_tokens=max(0, completion_tokens),
        cost_usd_micros=cost,
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """An HTTP refusal shaped for OpenAI clients: status, headers, and the error object.

    ``type`` is ``rate_limit_error`` when waiting helps (``Retry-After`` and
    ``retry-after-ms`` say how long), ``insufficient_quota`` when it does not within
    :data:`MAX_RETRY_AFTER_S` or never will (``x-should-retry: false`` stops every SDK).
    """

    status: int
    type: str
    message: str
    headers: dict[str, str]
    details: dict[str, Any]


def _names(decision: Decision) -> str:
    return ", ".join(decision.violated) or "a spendgate budget"


def refusal_of(decision: Decision, max_retry_after_s: int = MAX_RETRY_AFTER_S) -> Refusal:
    """The refusal a client sees for an admit or extend answered ``reject``."""
    wait = decision.retry_after_seconds
    tightest = min(
        (b for b in decision.budgets if b.policy in decision.violated),
        key=lambda b: b.remaining,
        default=None,
    )
    details: dict[str, Any] = {
        "violated": list(decision.violated),
        "retry_after_seconds": wait,
        "never_fits": decision.never_fits,
    }
    if tightest is not None:
        details.update(
            policy=tightest.policy,
            key=tightest.key,
            unit=tightest.unit,
            limit=tightest.limit,
            remaining=tightest.remaining,
            window_seconds=tightest.window_seconds,
        )
    if decision.reason:
        details["reason"] = decision.reason
    if decision.never_fits or wait is None:
        return Refusal(
            429,
            "insufficient_quota",
            f"Request exceeds the budget {_names(decision)}: it can never fit its window "
            "(lower max_tokens or the prompt).",
            {"x-should-retry": "false"},
            details,
        )
    if wait > max_retry_after_s:
        return Refusal(
            429,
            "insufficient_quota",
            f"Budget {_names(decision)} exhausted: it frees up in {wait} s.",
            {"x-should-retry": "false", "retry-after": str(wait)},
            details,
        )
    return Refusal(
        429,
        "rate_limit_error",
        f"Budget {_names(decision)} exhausted: retry in {wait} s.",
        {"retry-after": str(wait), "retry-after-ms": str(wait * 1000), "x-should-retry": "true"},
        details,
    )


def unavailable_refusal(why: str) -> Refusal:
    """The refusal when spendgate cannot decide and the request's policies fail closed."""
    return Refusal(
        503,
        "service_unavailable",
        f"Budget enforcement is unavailable ({why}); the budget fails closed.",
        {"retry-after": "1", "retry-after-ms": "1000", "x-should-retry": "true"},
        {"reason": why},
    )
