"""Names of the Redis keys the stream processor writes and the admission service reads.

Both sides import these, so the layout is defined once. Every name starts with the
configured prefix (``SPENDGATE_REDIS_PREFIX``, default ``sg:``).
"""

from __future__ import annotations


def window_key(prefix: str, key: str) -> str:
    """String holding one budget key's buckets in the ``schemas.window_codec`` layout."""
    return f"{prefix}w:{key}"


def pending_key(prefix: str, key: str) -> str:
    """Hash of reservations admission holds that the processor has not absorbed yet.

    Field = reservation id, value = ``"amount:expires_ms"``.
    """
    return f"{prefix}p:{key}"


def policies_key(prefix: str) -> str:
    """Hash of the policies in force: field = policy id, value = policy JSON."""
    return f"{prefix}policies"


def policies_version_key(prefix: str) -> str:
    """Counter bumped each time the policies hash is rewritten."""
    return f"{prefix}policies:version"


def request_key(prefix: str, tenant: str | None, request_id: str) -> str:
    """The first answer to an admit with this request id, scoped to the subject's tenant
    (idempotency): two tenants reusing one request id are two requests. The tenant is
    length-prefixed so no tenant or request id can address another pair."""
    scope = tenant or ""
    return f"{prefix}req:{len(scope)}:{scope}:{request_id}"


def reservation_key(prefix: str, reservation_id: str) -> str:
    """Hash of one reservation, written by the admit script: fields ``subject`` (JSON),
    ``plan`` (which model plan was reserved) and ``settled`` (once committed or
    released), read by commit and release."""
    return f"{prefix}res:{reservation_id}"
