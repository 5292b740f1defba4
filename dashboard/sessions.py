"""The dashboard's browser sessions: a random id (an HTTP-only cookie) per sign-in."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spendgate.admission.auth import Principal

__all__ = ["Sessions"]


@dataclass
class Sessions:
    """Browser sessions: a random id (the HTTP-only cookie) -> who signed in, until when."""

    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    _live: dict[str, tuple[Principal, float]] = field(default_factory=dict)

    def open(self, who: Principal) -> str:
        """A new session for ``who``; returns its id."""
        now = self.clock()
        self._live = {k: v for k, v in self._live.items() if v[1] > now}
        sid = secrets.token_urlsafe(32)
        self._live[sid] = (who, now + self.ttl_s)
        return sid

    def get(self, sid: str | None) -> Principal | None:
        """Who holds session ``sid`` (``None``: no such session, or it ended)."""
        found = self._live.get(sid or "")
        if found is None or found[1] <= self.clock():
            return None
        return found[0]

    def close(self, sid: str | None) -> None:
        """End session ``sid``."""
        self._live.pop(sid or "", None)
