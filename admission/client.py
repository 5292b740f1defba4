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
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx

from spendgate.admission._client_http import MAX_HOLD_S as MAX_HOLD_S
from spendgate.admission._client_http import (
    RetryingClient,
    SubjectLike,
    UsageLike,
    admit_timeout,
    as_usage,
    raise_for,
    retriable,
    server_error,
    used,
)
from spendgate.admission.exceptions import AdmissionRequestError as AdmissionRequestError
from spendgate.admission.exceptions import AdmissionUnavailable
from spendgate.admission.exceptions import BudgetExceeded as BudgetExceeded
from spendgate.admission.generations import (
    AsyncGeneration,
    AsyncStream,
    Generation,
    Stream,
    SyncStream,
)
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Subject as Subject
from spendgate.schemas.events import Usage as Usage
from spendgate.schemas.key_ids import KeyIds

# The ``X as X`` imports keep names this module offered before the split importable from
# here (the README imports BudgetExceeded from it); ``__all__`` is what it always was.
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


class AdmissionClient(RetryingClient):
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
        key_ids: KeyIds | None = None,
    ) -> None:
        super().__init__(token, retries, backoff_s, max_backoff_s, key_ids)
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport)
        self._admit_timeout = admit_timeout(timeout_s)

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
            if retriable(response):
                last, failed = server_error(response), response
                continue
            raise_for(response, refusal_ok)
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
            "subject": self.subject_body(subject),
            "estimate": as_usage(estimate).model_dump(exclude_none=True),
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
                "usage": as_usage(usage).model_dump(exclude_none=True),
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
        first = as_usage(estimate)
        s = SyncStream(self.admit(subject, first, request_id), first, as_usage(step or first), self)
        try:
            yield s
        except BaseException:
            self._settle_quietly(s)
            raise
        self._settle(s)

    def _settle(self, gen: Generation) -> None:
        if used(gen.usage):
            assert gen.usage is not None
            self.commit(gen.reservation_id, gen.usage)
        else:
            self.release(gen.reservation_id)

    def _settle_quietly(self, gen: Generation) -> None:
        try:
            self._settle(gen)
        except Exception:  # never hide the caller's own exception
            logger.exception("settling reservation %s failed", gen.reservation_id)


class AsyncAdmissionClient(RetryingClient):
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
        key_ids: KeyIds | None = None,
    ) -> None:
        super().__init__(token, retries, backoff_s, max_backoff_s, key_ids)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s, transport=transport)
        self._admit_timeout = admit_timeout(timeout_s)

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
            if retriable(response):
                last, failed = server_error(response), response
                continue
            raise_for(response, refusal_ok)
            return response
        raise AdmissionUnavailable(f"{path} failed after {self.retries + 1} tries: {last}")

    async def admit(
        self, subject: SubjectLike, estimate: UsageLike, request_id: str | None = None
    ) -> Decision:
        """As :meth:`AdmissionClient.admit`."""
        body = {
            "request_id": request_id or uuid.uuid4().hex,
            "subject": self.subject_body(subject),
            "estimate": as_usage(estimate).model_dump(exclude_none=True),
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
                "usage": as_usage(usage).model_dump(exclude_none=True),
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
        first = as_usage(estimate)
        decision = await self.admit(subject, first, request_id)
        s = AsyncStream(decision, first, as_usage(step or first), self)
        try:
            yield s
        except BaseException:
            await asyncio.shield(self._settle_quietly(s))
            raise
        await self._settle(s)

    async def _settle(self, gen: Generation) -> None:
        if used(gen.usage):
            assert gen.usage is not None
            await self.commit(gen.reservation_id, gen.usage)
        else:
            await self.release(gen.reservation_id)

    async def _settle_quietly(self, gen: Generation) -> None:
        try:
            await self._settle(gen)
        except Exception:  # never hide the caller's own exception
            logger.exception("settling reservation %s failed", gen.reservation_id)
