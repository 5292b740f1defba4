"""The dashboard's browser sessions: signed cookies any replica checks, sign-outs in Redis.

A session is the cookie itself, not a record on a server: ``v1.<payload>.<signature>``,
the payload (base64url JSON) holding a random session id, the token's id and the instants
it was issued and expires (``iat``, ``exp``, wall-clock seconds), the signature an
HMAC-SHA256 of both first parts under the session secret
(``SPENDGATE_DASHBOARD_SESSION_SECRET_FILE``). Every dashboard process holding the secret
takes it: after a restart, and behind several replicas.

Who a session is for is looked up on each request from the token's id (a keyed hash of the
token's SHA-256, never the token or its plain digest): a token taken out of the tokens file
ends its sessions when the dashboard next starts, and a session never outgrants its token.

Signing out writes the session id to Redis (:func:`~schemas.redis_keys.signed_out_key`),
expiring when the cookie would have, and every request checks it (one ``EXISTS``): so a
copy of the cookie (another tab, a stolen one) is refused on every replica and after a
restart. The choice, over the others:

- a per-token "not before" would sign out every browser of a token a team shares;
- a short lifetime alone leaves a copied cookie valid until it ends;
- the records are bounded: one per sign-out within the last ``session_ttl_s``.

Without Redis a session cannot be checked: the request fails as the page's reads do (503).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from spendgate.admission.auth import Authorizer, Principal
from spendgate.schemas.redis_keys import signed_out_key

__all__ = ["MIN_SESSION_SECRET_BYTES", "RedisSignOuts", "SessionClaims", "Sessions", "SignOuts"]

#: The shortest session secret taken: it signs every session of the deployment.
MIN_SESSION_SECRET_BYTES = 16
_VERSION = "v1"
#: Separates the two uses of the secret (signing cookies, naming tokens).
_SIGN = b"spendgate-dashboard-session\0"
_TOKEN = b"spendgate-dashboard-token\0"
#: How far in the future a cookie's issue instant may be: clocks of replicas differ.
_SKEW_S = 60


class SignOuts(Protocol):
    """Where sign-outs are kept, shared by every replica."""

    async def sign_out(self, sid: str, until_s: int) -> None:
        """Record that session ``sid`` ended; the record may go at ``until_s`` (epoch s)."""

    async def signed_out(self, sid: str) -> bool:
        """Whether session ``sid`` was signed out."""


class RedisSignOuts:
    """Sign-outs as Redis keys beside the policies (the control shard on a cluster)."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    async def sign_out(self, sid: str, until_s: int) -> None:
        """``SET`` the session's key, expiring at the cookie's own expiry."""
        await self.client.set(signed_out_key(self.prefix, sid), b"1", exat=until_s)

    async def signed_out(self, sid: str) -> bool:
        """Whether the session's key exists."""
        return bool(await self.client.exists(signed_out_key(self.prefix, sid)))


@dataclass(frozen=True, slots=True)
class SessionClaims:
    """What a session cookie says, once its signature is checked."""

    sid: str
    tid: str
    issued_s: int
    expires_s: int


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sessions:
    """Browser sessions as signed cookies (see the module's docstring)."""

    def __init__(
        self,
        secret: bytes,
        ttl_s: float,
        authorizer: Authorizer,
        sign_outs: SignOuts,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Args:
        secret: the session secret (at least :data:`MIN_SESSION_SECRET_BYTES`).
        ttl_s: how long a session lasts after sign-in.
        authorizer: the tokens, looked up by their ids on each request.
        sign_outs: where sign-outs are kept.
        clock: wall-clock seconds (cookies cross processes: no monotonic clock).
        """
        if len(secret) < MIN_SESSION_SECRET_BYTES:
            raise ValueError(
                f"the session secret must be at least {MIN_SESSION_SECRET_BYTES} bytes"
            )
        self._secret = secret
        self.ttl_s = ttl_s
        self.sign_outs = sign_outs
        self.clock = clock
        self._principals = {
            self._token_id(digest): principal for digest, principal in authorizer.known()
        }

    def _token_id(self, digest: bytes) -> str:
        return _b64(hmac.new(self._secret, _TOKEN + digest, hashlib.sha256).digest()[:18])

    def _signature(self, signed: str) -> str:
        return _b64(hmac.new(self._secret, _SIGN + signed.encode(), hashlib.sha256).digest())

    def open(self, token: str) -> str:
        """A new session cookie for ``token`` (a token the authorizer knows)."""
        now = int(self.clock())
        claims = {
            "sid": secrets.token_urlsafe(18),
            "tid": self._token_id(hashlib.sha256(token.encode()).digest()),
            "iat": now,
            "exp": now + max(1, int(self.ttl_s)),
        }
        signed = f"{_VERSION}.{_b64(json.dumps(claims, separators=(',', ':')).encode())}"
        return f"{signed}.{self._signature(signed)}"

    def claims(self, cookie: str | None) -> SessionClaims | None:
        """What ``cookie`` says, if this secret signed it and it has not expired (its
        sign-out not checked: see :meth:`get`)."""
        version, _, rest = (cookie or "").partition(".")
        payload, _, signature = rest.partition(".")
        if version != _VERSION or not payload or not signature:
            return None
        if not hmac.compare_digest(signature, self._signature(f"{version}.{payload}")):
            return None
        try:
            raw = json.loads(_unb64(payload))
            found = SessionClaims(
                str(raw["sid"]), str(raw["tid"]), int(raw["iat"]), int(raw["exp"])
            )
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        now = self.clock()
        if found.expires_s <= now or found.issued_s > now + _SKEW_S:
            return None
        return found

    async def get(self, cookie: str | None) -> Principal | None:
        """Who holds ``cookie`` (``None``: forged, tampered with, expired, signed out, or
        its token no longer known).

        Raises:
            redis.exceptions.RedisError: the sign-outs cannot be read.
        """
        found = self.claims(cookie)
        if found is None:
            return None
        principal = self._principals.get(found.tid)
        if principal is None or await self.sign_outs.signed_out(found.sid):
            return None
        return principal

    async def close(self, cookie: str | None) -> None:
        """Sign ``cookie``'s session out, on every replica, until it would have expired.

        Raises:
            redis.exceptions.RedisError: the sign-out cannot be written.
        """
        found = self.claims(cookie)
        if found is not None:
            await self.sign_outs.sign_out(found.sid, found.expires_s)
