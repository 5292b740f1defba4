"""Bearer tokens bound to the tenants they may act for.

The tokens file (``SPENDGATE_AUTH_TOKENS_FILE``, YAML or JSON) maps each token to a list
of tenants, to ``"*"`` for every tenant, or to ``operator``: a read-only token that sees
every tenant (``GET /v1/budgets``, the dashboard) and may not admit, commit or release::

    s3cr3t-acme: [acme]
    s3cr3t-ops: "*"
    s3cr3t-oncall: operator

Only SHA-256 digests of the tokens are kept in memory and compared in constant time;
no token is ever logged. The file is refused when group or others may read or write it.
Without it, a service listens only on a loopback address (:func:`check_exposure`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from spendgate.admission.exceptions import Forbidden, Unauthorized
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.key_settings import read_private_file

__all__ = [
    "ALL_TENANTS",
    "OPERATOR",
    "Authorizer",
    "Grant",
    "Principal",
    "check_exposure",
    "is_loopback",
    "load_tokens",
]

#: The grant of a token that may act for every tenant.
ALL_TENANTS = "*"
#: The grant of a read-only token that sees every tenant and acts for none.
OPERATOR: Literal["operator"] = "operator"
#: What a token may do: act for these tenants, for all (``None``), or read all (operator).
Grant = frozenset[str] | None | Literal["operator"]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenants it may act for (``None``: every tenant); an operator
    reads every tenant and acts for none."""

    tenants: frozenset[str] | None
    operator: bool = False

    def check(self, tenant: str | None, what: str = "subject.tenant") -> None:
        """Raise :class:`Forbidden` unless this principal may act for ``tenant``.

        A restricted token may not act for a subject without a tenant; an operator token
        may not act at all.
        """
        if self.operator:
            raise Forbidden("an operator token is read-only: it may not admit or settle", what)
        if self.tenants is None:
            return
        if tenant is None or tenant not in self.tenants:
            shown = repr(tenant) if tenant is not None else "(no tenant)"
            raise Forbidden(f"this token may not act for tenant {shown}", what)

    def may_read(self, tenant: str | None) -> bool:
        """Whether this principal may read ``tenant``'s budgets (``None``: no tenant)."""
        if self.operator or self.tenants is None:
            return True
        return tenant is not None and tenant in self.tenants

    def check_read(self, tenant: str | None, what: str = "tenant") -> None:
        """Raise :class:`Forbidden` unless this principal may read ``tenant``'s budgets."""
        if not self.may_read(tenant):
            shown = repr(tenant) if tenant is not None else "(no tenant)"
            raise Forbidden(f"this token may not read tenant {shown}", what)


#: The principal when auth is off.
ANYONE = Principal(None)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authorizer:
    """Resolve an ``Authorization`` header to a :class:`Principal`."""

    def __init__(self, grants: dict[str, Grant] | None) -> None:
        """Args: grants: token -> tenants (``None``: all); ``None`` turns auth off."""
        self.enabled = grants is not None
        self._grants = [(_digest(t), tenants) for t, tenants in (grants or {}).items()]

    def principal(self, authorization: str | None) -> Principal:
        """The caller behind ``authorization``.

        Raises:
            Unauthorized: auth is on and the header is missing, malformed or unknown.
        """
        if not self.enabled:
            return ANYONE
        if not authorization:
            raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("the Authorization header must be 'Bearer <token>'")
        digest = _digest(token)
        found: Grant = None
        known = False
        # Compare against every entry so the time taken does not depend on which matched.
        for candidate, tenants in self._grants:
            if hmac.compare_digest(candidate, digest):
                known, found = True, tenants
        if not known:
            raise Unauthorized("unknown bearer token")
        return _principal_of(found)

    def known(self) -> list[tuple[bytes, Principal]]:
        """Each known token's SHA-256 digest and its principal (the dashboard names the
        token of a session by a keyed hash of the digest, and looks it up here)."""
        return [(digest, _principal_of(grant)) for digest, grant in self._grants]


def _principal_of(grant: Grant) -> Principal:
    if grant == OPERATOR:
        return Principal(None, operator=True)
    return Principal(grant)


def load_tokens(path: Path) -> dict[str, Grant]:
    """Read a tokens file (token -> list of tenants, ``"*"``, or ``operator``).

    Raises:
        ConfigurationError: the file cannot be read, group or others may access it, or it
            is not such a mapping; the message never contains a token.
    """
    data = read_private_file(path, "the auth tokens file")
    try:
        text = data.decode("utf-8")
        raw: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (UnicodeDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"{path}: cannot read the auth tokens file: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigurationError(
            f"{path}: the auth tokens file maps token -> [tenants], '*' or 'operator'"
        )
    grants: dict[str, Grant] = {}
    for number, (token, tenants) in enumerate(raw.items(), start=1):
        if not isinstance(token, str) or not token:
            raise ConfigurationError(f"{path}: entry {number}: the token must be a string")
        if tenants == OPERATOR:
            grants[token] = OPERATOR
        elif tenants == ALL_TENANTS or (isinstance(tenants, list) and ALL_TENANTS in tenants):
            grants[token] = None
        elif isinstance(tenants, list) and all(isinstance(t, str) and t for t in tenants):
            grants[token] = frozenset(tenants)
        else:
            raise ConfigurationError(
                f"{path}: entry {number}: tenants must be a list of names, '*' or 'operator'"
            )
    return grants


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable from this machine only: ``localhost``, an
    address in 127.0.0.0/8 or ``::1`` (``0.0.0.0``, ``::``, any other name: not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(
    service: str, host: str, port: int, tokens_file: Path | None, allow_unauthenticated: bool
) -> None:
    """Refuse to listen beyond loopback with auth off, unless told so explicitly.

    Raises:
        ConfigurationError: ``host`` is not loopback, there is no tokens file and
            ``allow_unauthenticated`` is false (one line saying the three ways out).
    """
    if tokens_file is not None or allow_unauthenticated or is_loopback(host):
        return
    raise ConfigurationError(
        f"spendgate {service}: refusing to listen on {host}:{port} without auth: set "
        "SPENDGATE_AUTH_TOKENS_FILE (token -> tenants), or listen on 127.0.0.1, or pass "
        "--allow-unauthenticated (SPENDGATE_ALLOW_UNAUTHENTICATED=true)"
    )
