"""What the client's ``generation`` and ``stream`` blocks yield.

A :class:`Generation` holds the decision and the usage reported; a :class:`Stream` also
what is reserved so far and how it grows (sync and async flavours).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from spendgate.admission._client_http import UsageLike, as_usage
from spendgate.schemas.decisions import Decision
from spendgate.schemas.events import Usage

if TYPE_CHECKING:
    from spendgate.admission.client import AdmissionClient, AsyncAdmissionClient

__all__ = ["AsyncGeneration", "AsyncStream", "Generation", "Stream", "SyncStream"]


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
        self.usage = as_usage(usage)


AsyncGeneration = Generation

FIELDS = ("requests", "input_tokens", "cached_input_tokens", "output_tokens", "gpu_ms")


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
        for name in FIELDS:
            need = getattr(usage, name) - getattr(self.reserved, name)
            if need > 0:
                add[name] = max(need, getattr(self.step, name))
        return Usage(**add) if add else None

    def _begin(self, usage: UsageLike) -> Usage | bool:
        """Record ``usage``; the extend it needs, or the answer when it needs none."""
        self.usage = as_usage(usage)
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
        grown = {n: getattr(self.reserved, n) + getattr(add, n) for n in FIELDS}
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
