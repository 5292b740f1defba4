"""Key ids: secret subject values (API keys) replaced by a keyed hash at every edge.

A *key id* is ``sgk_`` + a 4-hex fingerprint of the secret + ``_`` + the first 24 hex
digits of ``HMAC-SHA256(secret, field NUL value)``. Budget keys, events, alerts, refusals,
logs and the dashboard carry only key ids, so a raw API key is never stored: admission
replaces it when a request arrives, the client library before it sends, the worker when a
record arrives raw, ``policy apply`` in a policy's ``match``.

Replacing is idempotent: a value that already is a key id is left as it is, so the same
value can pass several edges. The fingerprint names the secret a key id was made with:
ids made with another secret are recognisable (:meth:`KeyIds.foreign`) instead of looking
like unrelated raw values. 96 bits of MAC make collisions between keys negligible (the
birthday bound is ~2^48 keys), and the field name in the MAC input keeps the same value in
two fields from sharing an id.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import overload

import msgspec

from spendgate.schemas.events import Subject
from spendgate.schemas.exceptions import ConfigurationError, PolicyError
from spendgate.schemas.fastdecode import FastSubject
from spendgate.schemas.matching import GLOB_CHARS
from spendgate.schemas.policies import Policy
from spendgate.schemas.types import LABEL_PREFIX, SUBJECT_FIELDS

__all__ = ["BUILT_IN_SECRET", "DEFAULT_FIELDS", "PREFIX", "KeyIds", "secret_fields"]

#: What every key id starts with.
PREFIX = "sgk_"
#: The secret subject fields when none are configured.
DEFAULT_FIELDS: tuple[str, ...] = ("api_key",)
#: The secret used when none is configured: the hashing still keeps raw keys out of every
#: store, but anyone who knows a key can recompute its id. Deployments configure their own.
BUILT_IN_SECRET = b"spendgate built-in subject secret: public, configure your own"
#: Fields that cannot be secret: ``tenant`` is what tokens grant and records are keyed by,
#: ``model`` names the price, ``pool`` is what ``route`` writes.
_NEVER_SECRET = frozenset({"tenant", "model", "pool"})
_ID = re.compile(r"sgk_([0-9a-f]{4})_[0-9a-f]{24}")
_MAC_HEX = 24


def _is_any_id(value: str) -> bool:
    # The prefix test first: the regex runs only for values that may be key ids.
    return value.startswith(PREFIX) and _ID.fullmatch(value) is not None


def secret_fields(text: str) -> tuple[str, ...]:
    """Parse the comma-separated list of secret subject fields (``""``: none).

    Raises:
        ConfigurationError: a name is not a subject field, or is one that cannot be secret.
    """
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    for name in names:
        if name in _NEVER_SECRET:
            raise ConfigurationError(
                f"SPENDGATE_SECRET_FIELDS: {name!r} cannot be secret (tenant is what tokens "
                "grant and records are keyed by, model names the price, pool is what route sets)"
            )
        if name not in SUBJECT_FIELDS and not (
            name.startswith(LABEL_PREFIX) and len(name) > len(LABEL_PREFIX)
        ):
            raise ConfigurationError(
                f"SPENDGATE_SECRET_FIELDS: unknown subject field {name!r}; use "
                f"{', '.join(sorted(set(SUBJECT_FIELDS) - _NEVER_SECRET))} or labels.NAME"
            )
    return names


@dataclass(frozen=True, slots=True)
class KeyIds:
    """Turns the values of the secret subject fields into key ids.

    Args:
        secret: the HMAC key (every service of a deployment must share it).
        fields: the secret subject fields (``api_key``, ``user``, ``labels.NAME`` ...).
        built_in: whether ``secret`` is :data:`BUILT_IN_SECRET` (services warn then).
    """

    secret: bytes = field(repr=False)
    fields: tuple[str, ...] = DEFAULT_FIELDS
    built_in: bool = False
    fingerprint: str = field(init=False)
    _plain: tuple[str, ...] = field(init=False, repr=False)
    _labels: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.secret:
            raise ConfigurationError("the subject secret is empty")
        fp = hmac.new(self.secret, b"spendgate key-id fingerprint", hashlib.sha256).hexdigest()
        object.__setattr__(self, "fingerprint", fp[:4])
        plain = tuple(f for f in self.fields if not f.startswith(LABEL_PREFIX))
        labels = tuple(f.removeprefix(LABEL_PREFIX) for f in self.fields if f not in plain)
        object.__setattr__(self, "_plain", plain)
        object.__setattr__(self, "_labels", labels)

    @classmethod
    def built_in_secret(cls, fields: tuple[str, ...] = DEFAULT_FIELDS) -> KeyIds:
        """Key ids under the public built-in secret (what an unconfigured deployment uses)."""
        return cls(BUILT_IN_SECRET, fields, built_in=True)

    def of(self, value: str, field_name: str = "api_key") -> str:
        """The key id of ``value`` in ``field_name``; a key id is returned as it is."""
        if _is_any_id(value):
            return value
        # surrogatepass: a lone surrogate (JSON allows "\ud800") still has an id, where
        # a strict encode would raise in the middle of a dead letter.
        data = f"{field_name}\0{value}".encode("utf-8", "surrogatepass")
        mac = hmac.new(self.secret, data, hashlib.sha256).hexdigest()
        return f"{PREFIX}{self.fingerprint}_{mac[:_MAC_HEX]}"

    def is_id(self, value: str) -> bool:
        """Whether ``value`` is a key id made with this secret."""
        found = _ID.fullmatch(value)
        return found is not None and found.group(1) == self.fingerprint

    def foreign(self, value: str) -> bool:
        """Whether ``value`` is a key id made with another secret."""
        found = _ID.fullmatch(value)
        return found is not None and found.group(1) != self.fingerprint

    def foreign_field(self, subject: Subject | FastSubject) -> str | None:
        """The first secret field of ``subject`` (``api_key``, ``labels.NAME``) holding a key
        id made with another secret, or None: a caller or producer configured with another
        SPENDGATE_SUBJECT_SECRET, whose ids would name other budgets than this one's."""
        for name in self._plain:
            value = getattr(subject, name, None)
            if isinstance(value, str) and self.foreign(value):
                return name
        labels = subject.labels or {}
        for name in self._labels:
            value = labels.get(name)
            if isinstance(value, str) and self.foreign(value):
                return LABEL_PREFIX + name
        return None

    def secret_field(self, name: str) -> bool:
        """Whether subject field ``name`` is secret."""
        return name in self.fields

    @overload
    def subject(self, subject: Subject) -> Subject: ...
    @overload
    def subject(self, subject: FastSubject) -> FastSubject: ...
    @overload
    def subject(self, subject: Subject | FastSubject) -> Subject | FastSubject: ...

    def subject(self, subject: Subject | FastSubject) -> Subject | FastSubject:
        """``subject`` with every secret field a key id (the same object when it already is)."""
        changes: dict[str, object] = {}
        for name in self._plain:
            value = getattr(subject, name, None)
            if value is not None and not _is_any_id(value):
                changes[name] = self.of(value, name)
        labels = subject.labels
        if self._labels and labels:
            hidden = {
                k: self.of(v, LABEL_PREFIX + k) if k in self._labels and not _is_any_id(v) else v
                for k, v in labels.items()
            }
            if hidden != labels:
                changes["labels"] = hidden
        if not changes:
            return subject
        if isinstance(subject, Subject):
            return subject.model_copy(update=changes)
        return msgspec.structs.replace(subject, **changes)

    def query(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Subject ``(field, value)`` pairs with each secret field's value a key id."""
        return [(k, self.of(v, k) if k in self.fields else v) for k, v in pairs]

    def policy(self, policy: Policy) -> Policy:
        """``policy`` with each exact ``match`` value on a secret field replaced by its key id.

        ``"*"`` (any value present) is kept: it matches key ids as it matched raw values.

        Raises:
            PolicyError: a ``match`` value on a secret field is a glob: only key ids are
                stored, so no pattern over the raw values can be evaluated. The message
                names the field (``field match.api_key: ...``), not the policy, and does
                not repeat the pattern, which may hold part of a key. Or the value is a key
                id made with another secret (it would never match).
        """
        changed = dict(policy.match)
        for name, pattern in policy.match.items():
            if name not in self.fields or pattern == "*":
                continue
            if GLOB_CHARS.intersection(pattern):
                raise PolicyError(
                    f"field match.{name}: {name} is a secret field, "
                    "stored only as key ids, so it takes an exact value (hashed when applied) "
                    "or '*', not a glob; list the keys one policy each, or group_by "
                    f"{name} under a broader match"
                )
            if self.foreign(pattern):
                raise PolicyError(
                    f"field match.{name}: a key id made with another subject secret than "
                    f"this one's (sgk_{self.fingerprint}_...): it would match nothing; "
                    "apply with the deployment's SPENDGATE_SUBJECT_SECRET"
                )
            changed[name] = self.of(pattern, name)
        if changed == policy.match:
            return policy
        return policy.model_copy(update={"match": changed})

    def record(self, raw: bytes) -> bytes:
        """A usage record's bytes with its subject's secret fields as key ids, for a dead
        letter; bytes that are not a JSON object with a ``subject`` object are returned as
        they are (nothing in them can be found), as are bytes nested too deep to parse."""
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            return raw
        subject = doc.get("subject") if isinstance(doc, dict) else None
        if not isinstance(subject, dict):
            return raw
        changed = False
        for name in self._plain:
            value = subject.get(name)
            if isinstance(value, str) and not _is_any_id(value):
                subject[name], changed = self.of(value, name), True
        labels = subject.get("labels")
        if isinstance(labels, dict):
            for name in self._labels:
                value = labels.get(name)
                if isinstance(value, str) and not _is_any_id(value):
                    labels[name], changed = self.of(value, LABEL_PREFIX + name), True
        return json.dumps(doc, separators=(",", ":")).encode() if changed else raw
