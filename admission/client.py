"""A client of the admission service for inference workers, sync and async.

::

    client = AdmissionClient("http://127.0.0.1:8787", token="...")
    with client.generation({"tenant": "acme", "model": "m1"}, {"input_tokens": 900,
                                                             "output_tokens": 500}) as gen:
        for chunk in model.stream(max_tokens=gen.max_output_tokens or 500):
            gen.report(Usage(input_tokens=900, output_tokens=chunk.total_out))

On leaving the block the reservation is settled: the usage reported (the last
``report`` is the total so far) is committed, or the reservation is released when
nothing was reported. An exception or a cancellation mid-generation commits the partial
usage reported so far and is re-raised. Calls are retried on connection errors and 5xx
answers with the same ``request_id`` (admit) or ``reservation_id`` (commit/release), so
a retry never reserves twice and a commit or release is counted once. Retries are
bounded (``retries``) and back off exponentially with jitter (``backoff_s`` doubling up
to ``max_backoff_s``); a ``Retry-After`` from the service is honoured, capped at
``max_backoff_s``. A commit or release answered 503 ``outcome_unknown`` (Kafka did not
ack in time) is exactly such a retry: it returns once the event is in the log.

Streaming responses reserve a first slice and grow it as tokens flow::

    with client.stream(subject, {"input_tokens": 900, "output_tokens": 200},
                       step={"output_tokens": 200}) as s:
        for chunk in model.stream(max_tokens=4000):
            if not s.report(Usage(input_tokens=900, output_tokens=chunk.total_out)):
                break  # an extend was refused: stop the generation here

``report`` extends the reservation (``POST /v1/extend``, by at least ``step`` per field that
needs more) whenever the usage reported passes what is reserved, and answers False once
an extend is refused (``s.refusal`` says which budgets and what remains); the caller
stops generating. Leaving the block commits the usage reported (completion, an
exception, a cancellation, a client that went away: whatever ends the block), or
releases the reservation when nothing was reported. Extends are retried like commits,
with the same sequence number, so a retried extend grows the reservation once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx

from spendgate.admission.exceptions import (
    AdmissionRequestError,
    AdmissionUnavailable,
    BudgetExceeded,
)
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject, Usage

__all__ = [
    "AdmissionClient",
    "AsyncAdmissionClient",
    "AsyncGeneration",
    "AsyncStream",
    "Generation",
    "Stream",
    "SyncStream",
]

logger = logging.getLogger(__name__)

SubjectLike = Subject | Mapping[str, Any]
UsageLike = Usage | Mapping[str, Any]


def _subject(value: SubjectLike) -> Subject:
    return value if isinstance(value, Subject) else Subject.model_validate(value)


def _usage(value: UsageLike) -> Usage:
    return value if isinstance(value, Usage) else Usage.model_validate(value)


def _raise_for(response: httpx.Response, refusal_ok: bool = False) -> None:
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


def _retriable(response: httpx.Response) -> bool:
    return response.status_code >= 500


def _server_error(response: httpx.Response) -> AdmissionRequestError:
    try:
        error = response.json()["error"]
        return AdmissionRequestError(response.status_code, error["code"], error["message"])
    except (ValueError, KeyError, TypeError):
        return AdmissionRequestError(response.status_code, "server_error", response.text[:200])


def _retry_after_s(response: httpx.Response | None) -> float:
    """The ``Retry-After`` of a 5xx in seconds (0 when absent or an HTTP date)."""
    if response is None:
        return 0.0
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return 0.0


#: The longest an admission service holds an admit (a policy's ``max_delay`` is at most 60 s).
MAX_HOLD_S = 60.0


def _admit_timeout(timeout_s: float) -> httpx.Timeout:
    """``timeout_s`` for everything but reading an admit's answer, which may be held."""
    return httpx.Timeout(timeout_s, read=timeout_s + MAX_HOLD_S)


class _Base:
    def __init__(
        self, token: str | None, retries: int, backoff_s: float, max_backoff_s: float
    ) -> None:
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    def _wait(self, attempt: int, last: httpx.Response | None = None) -> float:
        """Seconds to sleep before retry number ``attempt + 1``.

        Exponential with jitter (half to all of ``backoff_s * 2**attempt``, so callers
        that failed together do not return together), at least the service's
        ``Retry-After``, never more than ``max_backoff_s``.
        """
        backoff = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        backoff *= random.uniform(0.5, 1.0)  # jitter, not secrecy
        return float(min(self.max_backoff_s, max(backoff, _retry_after_s(last))))


class Generation:
    """One admitted generation: its decision, and the usage reported so far."""

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self.usage: Usage | None = None

    @property
    def reservation_id(self) -> str:
        """The reservation to settle."""
        assert self.decision.reservation_id is not None
        return self.decision.reservation_id

    @property
    def max_output_tokens(self) -> int | None:
        """The output the caller must not exceed (set when the decision is ``cap``)."""
        return self.decision.max_output_tokens

    @property
    def model(self) -> str | None:
        """The model to serve (differs from the requested one on ``downgrade``)."""
        return self.decision.model

    @property
    def route_to(self) -> str | None:
        """The pool to serve it on (set when the decision is ``route``)."""
        return self.decision.route_to

    def report(self, usage: UsageLike) -> None:
        """Record the total usage so far (replaces what was reported before)."""
        self.usage = _usage(usage)


AsyncGeneration = Generation

_FIELDS = ("requests", "input_tokens", "cached_input_tokens", "output_tokens", "gpu_ms")


class Stream(Generation):
    """A streaming generation: what is reserved so far, grown by extends as it is used.

    Attributes:
        reserved: the estimate admitted plus every extend granted.
        step: the least an extend adds to a field that needs more.
        refusal: the 429 body of the extend that was refused (``None`` while none was).
    """

    def __init__(self, decision: Decision, estimate: Usage, step: Usage) -> None:
        super().__init__(decision)
        self.reserved = estimate
        self.step = step
        self.refusal: dict[str, Any] | None = None
        self.seq = 0

    @property
    def stopped(self) -> bool:
        """Whether an extend was refused: the generation must stop."""
        return self.refusal is not None

    def _needed(self, usage: Usage) -> Usage | None:
        """What to add so that ``usage`` is reserved (None: it already is)."""
        add: dict[str, int] = {}
        for name in _FIELDS:
            need = getattr(usage, name) - getattr(self.reserved, name)
            if need > 0:
                add[name] = max(need, getattr(self.step, name))
        return Usage(**add) if add else None

    def _begin(self, usage: UsageLike) -> Usage | bool:
        """Record ``usage``; the extend it needs, or the answer when it needs none."""
        self.usage = _usage(usage)
        if self.stopped:
            return False
        add = self._needed(self.usage)
        return True if add is None else add

    def _body(self, add: Usage) -> dict[str, Any]:
        self.seq += 1
        return {
            "reservation_id": self.reservation_id,
            "seq": self.seq,
            "add": add.model_dump(exclude_none=True, exclude_defaults=True),
        }

    def _answered(self, add: Usage, response: httpx.Response) -> bool:
        if response.status_code == 429:
            self.refusal = response.json()
            return False
        grown = {n: getattr(self.reserved, n) + getattr(add, n) for n in _FIELDS}
        self.reserved = Usage(**grown)
        return True


class AsyncStream(Stream):
    """:class:`Stream` for :meth:`AsyncAdmissionClient.stream` (``await s.report(...)``)."""

    def __init__(
        self, decision: Decision, estimate: Usage, step: Usage, client: AsyncAdmissionClient
    ) -> None:
        super().__init__(decision, estimate, step)
        self._client = client

    async def report(self, usage: UsageLike) -> bool:  # type: ignore[override]
        """As :meth:`SyncStream.report`."""
        add = self._begin(usage)
        if isinstance(add, bool):
            return add
        response = await self._client._post("/v1/extend", self._body(add), refusal_ok=True)
        return self._answered(add, response)


def _used(usage: Usage | None) -> bool:
    return usage is not None and usage != Usage()


class AdmissionClient(_Base):
    """Blocking client (httpx)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 5.0,
        retries: int = 5,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(token, retries, backoff_s, max_backoff_s)
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport)
        self._admit_timeout = _admit_timeout(timeout_s)

    def close(self) -> None:
        """Close the connections."""
        self._http.close()

    def __enter__(self) -> AdmissionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(
        self,
        path: str,
        body: dict[str, Any],
        refusal_ok: bool = False,
        read: httpx.Timeout | None = None,
    ) -> httpx.Response:
        last: Exception | None = None
        failed: httpx.Response | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self._wait(attempt - 1, failed))
            failed = None
            try:
                response = self._http.post(
                    path, json=body, headers=self.headers, timeout=read or self._http.timeout
                )
            except httpx.TransportError as exc:
                last = exc
                continue
            if _retriable(response):
                last, failed = _server_error(response), response
                continue
            _raise_for(response, refusal_ok)
            return response
        raise AdmissionUnavailable(f"{path} failed after {self.retries + 1} tries: {last}")

    def admit(
        self, subject: SubjectLike, estimate: UsageLike, request_id: str | None = None
    ) -> Decision:
        """Ask for admission; retries reuse ``request_id``.

        Raises:
            BudgetExceeded: 429, with ``retry_after_seconds`` or ``never_fits``.
            AdmissionRequestError: any other 4xx.
            AdmissionUnavailable: connection errors or 5xx after every retry.
        """
        body = {
            "request_id": request_id or uuid.uuid4().hex,
            "subject": _subject(subject).model_dump(exclude_none=True),
            "estimate": _usage(estimate).model_dump(exclude_none=True),
        }
        # A delay policy may hold the answer up to its max_delay: read that long.
        answer = self._post("/v1/admit", body, read=self._admit_timeout)
        return Decision.model_validate(answer.json())

    def commit(self, reservation_id: str, usage: UsageLike) -> None:
        """Charge the actual usage of a reservation."""
        self._post(
            "/v1/commit",
            {
                "reservation_id": reservation_id,
                "usage": _usage(usage).model_dump(exclude_none=True),
            },
        )

    def release(self, reservation_id: str) -> None:
        """Free a reservation that generated nothing."""
        self._post("/v1/release", {"reservation_id": reservation_id})

    @contextmanager
    def generation(
        self, subject: SubjectLike, estimate: UsageLike, request_id: str | None = None
    ) -> Iterator[Generation]:
        """Admit, yield the generation, then commit what was reported or release."""
        gen = Generation(self.admit(subject, estimate, request_id))
        try:
            yield gen
        except BaseException:
            self._settle_quietly(gen)
            raise
        self._settle(gen)

    @contextmanager
    def stream(
        self,
        subject: SubjectLike,
        estimate: UsageLike,
        step: UsageLike | None = None,
        request_id: str | None = None,
    ) -> Iterator[SyncStream]:
        """Admit ``estimate`` (the first slice), yield a stream that extends as it is used
        (by at least ``step``, default the estimate), then commit what was reported, or
        release when nothing was, however the block ends (see the module docstring).

        Raises:
            BudgetExceeded: the first slice was refused (429).
        """
        first = _usage(estimate)
        s = SyncStream(self.admit(subject, first, request_id), first, _usage(step or first), self)
        try:
            yield s
        except BaseException:
            self._settle_quietly(s)
            raise
        self._settle(s)

    def _settle(self, gen: Generation) -> None:
        if _used(gen.usage):
            assert gen.usage is not None
            self.commit(gen.reservation_id, gen.usage)
        else:
            self.release(gen.reservation_id)

    def _settle_quietly(self, gen: Generation) -> None:
        try:
            self._settle(gen)
        except Exception:  # never hide the caller's own exception
            logger.exception("settling reservation %s failed", gen.reservation_id)


class AsyncAdmissionClient(_Base):
    """Asyncio client (httpx)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 5.0,
        retries: int = 5,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(token, retries, backoff_s, max_backoff_s)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, transport=transport)
        self._admit_timeout = _admit_timeout(timeout_s)

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncAdmissionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post(
        self,
        path: str,
        body: dict[str, Any],
        refusal_ok: bool = False,
        read: httpx.Timeout | None = None,
    ) -> httpx.Response:
        last: Exception | None = None
        failed: httpx.Response | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self._wait(attempt - 1, failed))
            failed = None
            try:
                response = await self._http.post(
                    path, json=body, headers=self.headers, timeout=read or self._http.timeout
                )
            except httpx.TransportError as exc:
                last = exc
                continue
            if _retriable(response):
                last, failed = _server_error(response), response
                continue
            _raise_for(response, refusal_ok)
            return response
        raise AdmissionUnavailable(f"{path} failed after {self.retries + 1} tries: {last}")

    async def admit(
        self, subject: SubjectLike, estimate: UsageLike, request_id: str | None = None
    ) -> Decision:
        """As :meth:`AdmissionClient.admit`."""
        body = {
            "request_id": request_id or uuid.uuid4().hex,
            "subject": _subject(subject).model_dump(exclude_none=True),
            "estimate": _usage(estimate).model_dump(exclude_none=True),
        }
        # A delay policy may hold the answer up to its max_delay: read that long.
        answer = await self._post("/v1/admit", body, read=self._admit_timeout)
        return Decision.model_validate(answer.json())

    async def commit(self, reservation_id: str, usage: UsageLike) -> None:
        """Charge the actual usage of a reservation."""
        await self._post(
            "/v1/commit",
            {
                "reservation_id": reservation_id,
                "usage": _usage(usage).model_dump(exclude_none=True),
            },
        )

    async def release(self, reservation_id: str) -> None:
        """Free a reservation that generated nothing."""
        await self._post("/v1/release", {"reservation_id": reservation_id})

    @asynccontextmanager
    async def generation(
        self, subject: SubjectLike, estimate: UsageLike, request_id: str | None = None
    ) -> AsyncIterator[Generation]:
        """As :meth:`AdmissionClient.generation`; a cancellation commits the partial usage."""
        gen = Generation(await self.admit(subject, estimate, request_id))
        try:
            yield gen
        except BaseException:
            # Shielded: a cancelled task still settles what it used.
            await asyncio.shield(self._settle_quietly(gen))
            raise
        await self._settle(gen)

    @asynccontextmanager
    async def stream(
        self,
        subject: SubjectLike,
        estimate: UsageLike,
        step: UsageLike | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[AsyncStream]:
        """As :meth:`AdmissionClient.stream`; a cancellation commits the partial usage."""
        first = _usage(estimate)
        decision = await self.admit(subject, first, request_id)
        s = AsyncStream(decision, first, _usage(step or first), self)
        try:
            yield s
        except BaseException:
            await asyncio.shield(self._settle_quietly(s))
            raise
        await self._settle(s)

    async def _settle(self, gen: Generation) -> None:
        if _used(gen.usage):
            assert gen.usage is not None
            await self.commit(gen.reservation_id, gen.usage)
        else:
            await self.release(gen.reservation_id)

    async def _settle_quietly(self, gen: Generation) -> None:
        try:
            await self._settle(gen)
        except Exception:  # never hide the caller's own exception
            logger.exception("settling reservation %s failed", gen.reservation_id)


class SyncStream(Stream):
    """:class:`Stream` for :meth:`AdmissionClient.stream`."""

    def __init__(
        self, decision: Decision, estimate: Usage, step: Usage, client: AdmissionClient
    ) -> None:
        super().__init__(decision, estimate, step)
        self._client = client

    def report(self, usage: UsageLike) -> bool:  # type: ignore[override]
        """Record the usage so far; extend when it passes what is reserved.

        Returns:
            False once an extend was refused (stop the generation), else True.
        """
        add = self._begin(usage)
        if isinstance(add, bool):
            return add
        response = self._client._post("/v1/extend", self._body(add), refusal_ok=True)
        return self._answered(add, response)
