"""Names of the Redis keys the stream processor writes and the admission service reads.

Both sides import these, so the layout is defined once. Every name starts with the
configured prefix (``SPENDGATE_REDIS_PREFIX``, default ``sg:``).
"""

from __future__ import annotations


def window_key(prefix: str, key: str) -> str:
    """String holding one budget key's buckets in the ``schemas.window_codec`` layout."""
    return f"{prefix}w:{key}"


def window_version_key(prefix: str, key: str) -> str:
    """The version of the window written (the worker's count of records applied to the
    key), so a drift heal never overwrites a newer window. Admission does not read it."""
    return f"{prefix}wv:{key}"


def utilization_key(prefix: str) -> str:
    """Sorted set indexing every budget window by utilization: member = the window's key
    (:func:`window_key`), score = the window's total over the policy's limit when it was
    last written (the worker's window writes and heals, in the same atomic step). Read by
    the dashboard for top-N and paging without decoding every window; a member whose
    window expired is removed by whoever finds it so."""
    return f"{prefix}util"


def pending_window_key(prefix: str, key: str) -> str:
    """Hash of the reservations admission holds that the processor has not absorbed yet,
    summed per bucket: field = the last millisecond of a bucket (its admission instant's,
    on the Redis clock), value = the amount pending there (``schemas.window_codec``:
    ``pending_field``, ``decode_pending``). The admit script reads it whole, so its size is
    bounded by the buckets of one window, never by how many reservations are open; it adds
    to it and prunes buckets that aged out, the processor's absorb subtracts from it."""
    return f"{prefix}pw:{key}"


def pending_total_key(prefix: str, key: str) -> str:
    """Hash of the version-2 pending window: the bucket fields of
    :func:`pending_window_key` plus ``window_codec.PENDING_TOTAL_FIELD``, their sum, and
    each reservation's pending entry under ``redis_values.PENDING_ENTRY_PREFIX`` + its id. The
    admit script reads the sum, the boundary bucket and the newest bucket, never the
    whole hash, and ages buckets out in the order :func:`pending_queue_key` holds; the
    processor's absorb subtracts from a field and the sum together (and deletes both keys
    when the sum reaches 0). Written while the key's absorbed window is a version-2 value
    (``schemas.window_codec``); both versions count while both exist."""
    return f"{prefix}pv:{key}"


def pending_queue_key(prefix: str, key: str) -> str:
    """List of the fields of :func:`pending_total_key`, oldest bucket first, each once
    (pushed when a bucket first holds an amount): the admit script pops buckets that left
    the window from its head and absorbed-away ones from its tail. An entry whose field
    is gone is skipped wherever it is met."""
    return f"{prefix}pq:{key}"


def pending_reservations_key(prefix: str, key: str) -> str:
    """Hash of where each pending reservation sits in the pending window, so the
    processor can absorb it: field = reservation id, value = ``"field:amount"`` (the
    pending-window field and the amount added there). Written by the admit script, read
    and deleted one field at a time by the processor's absorb; never read in bulk. Only
    for the version-1 pending window: a reservation held in the version-2 one has its entry
    in that hash (:func:`pending_total_key`, ``redis_values.PENDING_ENTRY_PREFIX``), where
    a previous release's absorb never looks (it leaves the amount to age out rather than
    miscount it)."""
    return f"{prefix}pr:{key}"


def pending_expiry_key(prefix: str, key: str) -> str:
    """List of the holds not yet absorbed, oldest first: ``"<due ms>:<pending window
    version>:<entry name>"``, the due instant being the hold's instant plus its policy's
    ``reservation_ttl`` (Redis clock). Pushed by every hold; the admit and
    extend scripts pop absorbed holds from its head, and expire due ones that are still
    pending (their entry goes, their amount stays counted until the worker's windows hold
    it: ``admission/scripts/key_steps.lua``, "Expiry"). So a key holds at most one
    ``reservation_ttl`` of entries, even while no worker absorbs them."""
    return f"{prefix}pe:{key}"


def held_keys(prefix: str, key: str) -> tuple[str, str, str, str, str, str]:
    """The six keys that hold one budget key's usage, in the order the admit and extend
    scripts take them: :func:`window_key`, :func:`pending_window_key`,
    :func:`pending_total_key`, :func:`pending_queue_key`, :func:`pending_reservations_key`,
    :func:`pending_expiry_key`."""
    return (
        window_key(prefix, key),
        pending_window_key(prefix, key),
        pending_total_key(prefix, key),
        pending_queue_key(prefix, key),
        pending_reservations_key(prefix, key),
        pending_expiry_key(prefix, key),
    )


def burst_key(prefix: str, key: str) -> str:
    """String holding one budget key's token bucket (policy ``burst``), ``level:at_ms``
    (``schemas.burst``): written by the admit script with an expiry at the instant the
    bucket would be full again, so a missing key is a full bucket (also after a Redis
    loss: bursts are limited again from a full bucket; the window keeps the allowance)."""
    return f"{prefix}bt:{key}"


def extend_key(prefix: str, reservation_id: str, seq: int) -> str:
    """The stored answer of a reservation's ``seq``-th extend (``POST /v1/extend``), so a
    retried extend grows nothing twice and returns the first answer."""
    return f"{prefix}ext:{seq}:{reservation_id}"


def overage_key(prefix: str, key: str) -> str:
    """The last overage of a budget key (``schemas.overage.OverageMark``: ratio and
    instant), written by the worker, read by admission for ``overage: cap_next`` policies;
    expires a window after it was written."""
    return f"{prefix}ov:{key}"


def policies_key(prefix: str) -> str:
    """Hash of the policies in force: field = policy id, value = policy JSON."""
    return f"{prefix}policies"


def policies_version_key(prefix: str) -> str:
    """Counter bumped each time the policies hash is rewritten."""
    return f"{prefix}policies:version"


def signed_out_key(prefix: str, sid: str) -> str:
    """Set when the dashboard session ``sid`` signs out, expiring when its cookie would have
    (``dashboard.sessions``): every replica refuses the cookie while it exists."""
    return f"{prefix}dash:out:{sid}"


def request_key(prefix: str, tenant: str | None, request_id: str) -> str:
    """The first answer to an admit with this request id, scoped to the subject's tenant
    (idempotency): two tenants reusing one request id are two requests. The tenant is
    length-prefixed so no tenant or request id can address another pair."""
    scope = tenant or ""
    return f"{prefix}req:{len(scope)}:{scope}:{request_id}"


def reservation_key(prefix: str, reservation_id: str) -> str:
    """Hash of one reservation, written by the admit script: fields ``subject`` (JSON),
    ``plan`` (which model plan was reserved) and ``settled`` (once committed or
    released), read by commit and release; and what its ``reserve`` event is rebuilt from
    (``admission.reserves``): ``usage`` (the estimate, JSON), ``at`` (the admission
    instant, ms on the Redis clock), ``out`` (the capped output tokens, -1 when not
    capped) and ``ttl`` (the longest reservation TTL of the reserved plan, ms; 0: none)."""
    return f"{prefix}res:{reservation_id}"


def unpublished_reserves_key(prefix: str) -> str:
    """Sorted set of the reservations whose ``reserve`` event Kafka has not acknowledged
    yet: member = reservation id, score = the admission instant (ms, Redis clock), or the
    instant an admission process last claimed it for republishing. Added to by the admit
    script in the same atomic step as the reservation, removed from (in batches) once the
    broker acked the reserve; entries older than a grace period are republished from
    :func:`reservation_key` by any admission process (``admission.sweeper``)."""
    return f"{prefix}unpub"


def provisional_key(prefix: str) -> str:
    """Sorted set of one shard's pieces of reservations that span shards
    (``admission.shards``): member = reservation id, score = its deadline (ms, Redis
    clock). A piece leaves once its reservation is sealed or released; one still listed
    past its deadline is resolved by a sweeper against its home shard."""
    return f"{prefix}prov"


def piece_key(prefix: str, reservation_id: str) -> str:
    """What one shard's piece of a reservation holds (JSON list of its budget keys),
    for its release; written by the admit script beside the piece's holds."""
    return f"{prefix}piece:{reservation_id}"


def tombstone_key(prefix: str, reservation_id: str) -> str:
    """Set on a reservation's home shard by a sweeper before it releases a piece left past
    its deadline: the reservation can no longer be sealed (``admission.scripts.seal``)."""
    return f"{prefix}tomb:{reservation_id}"


def marks_key(prefix: str) -> str:
    """Hash of the applied marks, one field per worker partition (``schemas.shards``):
    value = the applied watermark W in ms (every record of the partition with a log-append
    time <= W is applied in Redis; see ``streams.marks``). A field exists only while its
    worker vouches for every window of that partition; the admit script refuses to decide
    on a key whose marks are missing or older than the staleness bound."""
    return f"{prefix}marks"


def mark_owners_key(prefix: str) -> str:
    """Hash of the fencing token of each mark's owner (same fields as :func:`marks_key`):
    an integer issued by Redis (HINCRBY) each time a worker is assigned the partition. The
    mark script refuses a write with a lower token, or a lower watermark with the same."""
    return f"{prefix}marks:owner"


def mark_positions_key(prefix: str) -> str:
    """Hash of each mark's position (same fields as :func:`marks_key`): the next offset to
    apply; every record of the partition before it is applied in Redis. Written with the
    mark, only ever raised; a partition's next owner starts from it rather than from the
    group's committed offset, which lags by up to a commit interval."""
    return f"{prefix}marks:position"


def mark_progress_key(prefix: str) -> str:
    """Hash of each mark's progress as its owner last saw it (same fields as
    :func:`marks_key`): ``"<records behind>:<Redis ms when measured>"``, written with the
    mark (``GET /v1/status`` shows it as the worker's lag)."""
    return f"{prefix}marks:progress"


def topology_key(prefix: str) -> str:
    """The partition counts the marks refer to (``schemas.shards.Topology``), written by
    the worker beside the policies."""
    return f"{prefix}topology"
