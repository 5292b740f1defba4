"""The admission client's plumbing: argument coercion, error mapping and retry waits."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import httpx

from spendgate.admission.exceptions import AdmissionRequestError, BudgetExceeded
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.key_ids import KeyIds

SubjectLike = Subject | Mapping[str, Any]
UsageLike = Usage | Mapping[str, Any]


def as_subject(value: SubjectLike) -> Subject:
    """``value`` as a :class:`Subject` (validated when given as a mapping)."""
    return value if isinstance(value, Subject) else Subject.model_validate(value)


def as_usage(value: UsageLike) -> Usage:
    """``value`` as a :class:`Usage` (validated when given as a mapping)."""
    return value if isinstance(value, Usage) else Usage.model_validate(value)


def raise_for(response: httpx.Response, refusal_ok: bool = False) -> None:
    """Raise what a 4xx answer means (a 429 passes when ``refusal_ok``).

    Raises:
        BudgetExceeded: 429, unless ``refusal_ok``.
        AdmissionRequestError: any other 4xx (or 5xx).
    """
    if response.status_code == 429 and refusal_ok:
        return
    if response.status_code == 429:
        raise BudgetExceeded(Decision.model_validate(response.json()))
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
            code, message, field = error["code"], error["message"], error.get("field")
        except (ValueError, KeyError, TypeError):
            code, message, field = "http_error", response.text[:200], None
        raise AdmissionRequestError(response.status_code, code, message, field)


def retriable(response: httpx.Response) -> bool:
    """Whether the call is retried (5xx: the same id makes a retry safe)."""
    return response.status_code >= 500


def server_error(response: httpx.Response) -> AdmissionRequestError:
    """The error a 5xx answer stands for (raised once every retry failed)."""
    try:
        error = response.json()["error"]
        return AdmissionRequestError(response.status_code, error["code"], error["message"])
    except (ValueError, KeyError, TypeError):
        return AdmissionRequestError(response.status_code, "server_error", response.text[:200])


def retry_after_s(response: httpx.Response | None) -> float:
    """The ``Retry-After`` of a 5xx in seconds (0 when absent or an HTTP date)."""
    if response is None:
        return 0.0
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return 0.0


#: The longest an admission service holds an admit (a policy's ``max_delay`` is at most 60 s).
MAX_HOLD_S = 60.0


def admit_timeout(timeout_s: float) -> httpx.Timeout:
    """``timeout_s`` for everything but reading an admit's answer, which may be held."""
    return httpx.Timeout(timeout_s, read=timeout_s + MAX_HOLD_S)


class RetryingClient:
    """What both clients share: the token's header and the retry policy."""

    def __init__(
        self,
        token: str | None,
        retries: int,
        backoff_s: float,
        max_backoff_s: float,
        key_ids: KeyIds | None = None,
    ) -> None:
        self.key_ids = key_ids
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def subject_body(self, subject: SubjectLike) -> dict[str, Any]:
        """The subject as sent: with ``key_ids``, secret fields replaced by their key ids
        here, so a raw API key never leaves this process."""
        value = as_subject(subject)
        if self.key_ids is not None:
            value = self.key_ids.subject(value)
        return value.model_dump(exclude_none=True)

    def _wait(self, attempt: int, last: httpx.Response | None = None) -> float:
        """Seconds to sleep before retry number ``attempt + 1``.

        Exponential with jitter (half to all of ``backoff_s * 2**attempt``, so callers
        that failed together do not return together), at least the service's
        ``Retry-After``, never more than ``max_backoff_s``.
        """
        backoff = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        backoff *= random.uniform(0.5, 1.0)  # jitter, not secrecy
        return float(min(self.max_backoff_s, max(backoff, retry_after_s(last))))


def used(usage: Usage | None) -> bool:
    """Whether anything was reported (commit it) or not (release the reservation)."""
    return usage is not None and usage != Usage()
