"""Compact binary layout of one budget key's buckets, shared by RocksDB values and Redis.

The same bytes are a RocksDB table value in the stream processor and a Redis string
that the admission Lua script reads with ``struct.unpack`` (``schemas/window.lua``).
All integers are little-endian. Layout, version 2 (what ``encode`` writes)::

    offset size  type  field
    0      1     u8    version, 2
    1      1     u8    kind: 0 = sparse, 1 = dense
    2      4     u32   bucket_ms (1 .. 2**32 - 1)
    6      8     i64   base_ms: start of the oldest non-empty bucket (0 when empty)
    14     4     u32   n: number of entries that follow
    18     8     i64   neg_ms: start of the newest bucket with a negative amount, -1: none
    26     8     i64   sum: the sum of every amount (the last prefix)
    34     ...         body

    dense body: n slots of 8 bytes; slot i covers the bucket at base_ms + i * bucket_ms
      +0   8     i64   prefix: the sum of the amounts of every bucket up to and including
                       this one (first and last bucket non-zero)
    then the summary: ceil(n / 32) entries of 8 bytes; entry k is slot
      min(32 * k + 31, n - 1)'s prefix (the last entry: the window's sum)
    sparse body: n entries of 12 bytes, offsets strictly increasing
      +0   4     u32   offset: the bucket starts at base_ms + offset * bucket_ms
      +4   8     i64   prefix: the sum of the amounts up to and including this bucket
                       (each bucket's own amount, prefix minus the previous one, non-zero)

Prefix sums make the trailing total and the boundary bucket two or three reads at
computed offsets, whatever the window's length (``window.lua``: ``window_view``); ``neg_ms``
tells a reader in O(1) whether the total over later instants can only fall (no negative
amount from the boundary bucket on), which is what lets the refused path search for its
Retry-After instead of walking every bucket; the dense summary lets that search read the
summary and one group of 32 slots, never the whole value.

Version 1 (still read, never written; a worker of the previous release writes it) has
the 18-byte header without ``neg_ms`` and each bucket's own amount instead of the prefix.

``encode`` picks whichever body is smaller (dense when its slots and summary take no more
than ``12 * n`` bytes, with ``span`` the buckets from the oldest to the newest non-empty
one), except that a sparse body is never longer than ``SPARSE_MAX_BYTES``: admission reads
a sparse value whole and a dense one in place, so every value costs it the same. The empty state is
the 34-byte header with ``n = 0``. Sizes: a dense 24 h window of 1 min buckets (1440
non-empty buckets) is 11,914 bytes; 60 sparse buckets are 754 bytes.

Lua numbers are doubles, exact to 2**53, so ``encode`` refuses a state whose absolute
amounts sum to more than ``MAX_SAFE_AMOUNT``: every prefix and every partial sum the Lua
side forms (totals, prorated shares) then stays exact.

The *pending window* (reservations admission holds that the processor has not absorbed)
is a Redis hash instead, updated in place by the scripts: field = the decimal *last*
millisecond of the bucket a reservation was admitted in (``pending_field``), value = the
amount pending there. Naming a bucket by its last millisecond lets a reader in any bucket
width place it as ``schemas.windows.rebucket`` would (``decode_pending``), so a policy
whose ``bucket`` changed needs no rewrite. Two layouts (``redis_keys``):

* version 1, ``pending_window_key``: the bucket fields only, read whole by the admit
  script; written while the key's absorbed window is a version-1 value (its worker is of
  the previous release, whose absorb knows only this one);
* version 2, ``pending_total_key``: the same fields plus ``PENDING_TOTAL_FIELD``, the sum
  of them all, and each reservation's pending entry (``redis_values``), with the bucket
  fields in bucket order in a list (``pending_queue_key``), so the
  admit script reads the total, the boundary bucket and the newest bucket and ages old
  buckets out from the list's head, amortized O(1) whatever the window. Written while the
  absorbed window is a version-2 value.

Every reader counts both (``read_held``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from itertools import accumulate
from typing import NamedTuple

from spendgate.schemas.windows import merge, rebucket

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KIND_DENSE",
    "KIND_SPARSE",
    "MAX_SAFE_AMOUNT",
    "PENDING_TOTAL_FIELD",
    "SPARSE_MAX_BYTES",
    "SUMMARY_GROUP",
    "DecodedState",
    "decode",
    "decode_pending",
    "encode",
    "pending_field",
    "pending_fields",
    "read",
    "read_held",
]

#: The version ``encode`` writes.
FORMAT_VERSION = 2
KIND_SPARSE = 0
KIND_DENSE = 1
#: Largest integer a double (a Lua number in Redis) holds exactly.
MAX_SAFE_AMOUNT = 2**53 - 1
#: The longest sparse body ``encode`` writes (version 2): a sparse value is read whole, a
#: dense one in place, so anything longer is written dense.
SPARSE_MAX_BYTES = 2048
#: Dense slots per entry of a version-2 value's summary.
SUMMARY_GROUP = 32
#: The field of a version-2 pending window that holds the sum of its bucket fields.
PENDING_TOTAL_FIELD = "t"

_HEADER_V1 = struct.Struct("<BBIqI")
_HEADER = struct.Struct("<BBIqIqq")
_PAIR = struct.Struct("<Iq")
_U32_MAX = 2**32 - 1
_I64_MAX = 2**63 - 1
HEADER_SIZE = _HEADER.size
_HEADERS = {1: _HEADER_V1, 2: _HEADER}


class DecodedState(NamedTuple):
    """A decoded value: the bucket width it was written with and its buckets."""

    bucket_ms: int
    buckets: dict[int, int]


def encode(buckets: Mapping[int, int], bucket_ms: int, version: int = FORMAT_VERSION) -> bytes:
    """Encode buckets (start ms -> amount) in the compact layout.

    Zero amounts are skipped.

    Args:
        buckets: bucket start (a non-negative multiple of ``bucket_ms``) -> amount.
        bucket_ms: the bucket width.
        version: 2 (the default), or 1: the previous release's layout, for tests and
            benchmarks of a mixed deployment only.

    Returns:
        The encoded bytes, sparse or dense, whichever is smaller.

    Raises:
        ValueError: ``bucket_ms`` does not fit a u32, a start is negative or not aligned,
            the buckets span more than 2**32 buckets, the absolute amounts sum to more
            than ``MAX_SAFE_AMOUNT`` (Lua could not add them exactly), or an unknown
            version.
    """
    if version not in _HEADERS:
        raise ValueError(f"version: {version} is not 1 or 2")
    if not 1 <= bucket_ms <= _U32_MAX:
        raise ValueError(f"bucket_ms: {bucket_ms} must be between 1 and {_U32_MAX}")
    items = sorted((start, amount) for start, amount in buckets.items() if amount)
    if not items:
        return _header(version, KIND_SPARSE, bucket_ms, 0, 0, -1, 0)
    magnitude = 0
    for start, amount in items:
        if start < 0 or start % bucket_ms:
            raise ValueError(
                f"bucket start {start} must be a non-negative multiple of bucket_ms {bucket_ms}"
            )
        magnitude += abs(amount)
    if magnitude > MAX_SAFE_AMOUNT:
        raise ValueError(
            f"amounts sum to {magnitude} in absolute value, over 2**53 - 1: the Lua side "
            "cannot add them exactly; use a coarser unit"
        )
    base = items[0][0]
    last = (items[-1][0] - base) // bucket_ms
    if last > _U32_MAX or base > _I64_MAX:
        raise ValueError(f"buckets span {last + 1} buckets from {base}: too wide to encode")
    negative = [start for start, amount in items if amount < 0]
    total = sum(amount for _, amount in items)
    neg_ms = negative[-1] if negative else -1
    values = [amount for _, amount in items]
    if version == 2:
        values = list(accumulate(values))
    span = last + 1
    dense_size = 8 * span + (8 * -(-span // SUMMARY_GROUP) if version == 2 else 0)
    sparse_size = 12 * len(items)
    if dense_size <= sparse_size or (version == 2 and sparse_size > SPARSE_MAX_BYTES):
        slots = [0] * span
        for start, amount in items:
            slots[(start - base) // bucket_ms] = amount
        if version == 2:
            slots = list(accumulate(slots))  # an empty bucket's prefix is the one before
            slots += _summary(slots)
        header = _header(version, KIND_DENSE, bucket_ms, base, span, neg_ms, total)
        return header + struct.pack(f"<{len(slots)}q", *slots)
    body = b"".join(
        _PAIR.pack((start - base) // bucket_ms, value)
        for (start, _), value in zip(items, values, strict=True)
    )
    return _header(version, KIND_SPARSE, bucket_ms, base, len(items), neg_ms, total) + body


def _summary(prefixes: list[int]) -> list[int]:
    """The dense summary: every ``SUMMARY_GROUP``-th prefix, and the last."""
    n = len(prefixes)
    return [prefixes[min(k + SUMMARY_GROUP - 1, n - 1)] for k in range(0, n, SUMMARY_GROUP)]


def _header(
    version: int, kind: int, bucket_ms: int, base: int, n: int, neg_ms: int, total: int
) -> bytes:
    if version == 1:
        return _HEADER_V1.pack(1, kind, bucket_ms, base, n)
    return _HEADER.pack(2, kind, bucket_ms, base, n, neg_ms, total)


def decode(data: bytes) -> DecodedState:
    """Decode bytes written by ``encode``, of either version.

    Args:
        data: the encoded value.

    Returns:
        The bucket width and the non-empty buckets.

    Raises:
        ValueError: the bytes are not a valid value (unknown version or kind, truncated
            or trailing bytes, unordered sparse offsets, a zero amount where none may be,
            a version-2 ``neg_ms`` that is not the newest negative bucket).
    """
    version = data[0] if data else 0
    header = _HEADERS.get(version)
    if header is None:
        raise ValueError(f"window state: unknown format version {version}")
    if len(data) < header.size:
        raise ValueError(f"window state: {len(data)} bytes is shorter than the header")
    fields = header.unpack_from(data)
    _, kind, bucket_ms, base, count = fields[:5]
    if bucket_ms == 0:
        raise ValueError("window state: bucket_ms is 0")
    body = len(data) - header.size
    starts: list[int] = []
    values: list[int] = []
    if kind == KIND_DENSE:
        groups = -(-count // SUMMARY_GROUP) if version == 2 else 0
        if body != 8 * (count + groups):
            raise ValueError(f"window state: dense body of {body} bytes for {count} slots")
        values = list(struct.unpack_from(f"<{count}q", data, header.size))
        summary = struct.unpack_from(f"<{groups}q", data, header.size + 8 * count)
        if version == 2 and list(summary) != (_summary(values) if count else []):
            raise ValueError("window state: the dense summary does not match its slots")
        starts = [base + index * bucket_ms for index in range(count)]
    elif kind == KIND_SPARSE:
        if body != _PAIR.size * count:
            raise ValueError(f"window state: sparse body of {body} bytes for {count} entries")
        previous = -1
        for offset, value in _PAIR.iter_unpack(data[header.size :]):
            if offset <= previous:
                raise ValueError("window state: sparse offsets must increase")
            previous = offset
            starts.append(base + offset * bucket_ms)
            values.append(value)
    else:
        raise ValueError(f"window state: unknown kind {kind}")
    amounts = values
    if version == 2:
        amounts = [value - before for value, before in zip(values, [0, *values], strict=False)]
    if kind == KIND_SPARSE and not all(amounts):
        raise ValueError("window state: a sparse entry's amount is zero")
    buckets = {start: amount for start, amount in zip(starts, amounts, strict=True) if amount}
    if version == 2:
        negative = [start for start, amount in buckets.items() if amount < 0]
        if fields[5] != (max(negative) if negative else -1):
            raise ValueError(f"window state: neg_ms {fields[5]} is not the newest negative bucket")
        if fields[6] != sum(buckets.values()):
            raise ValueError(f"window state: sum {fields[6]} is not the sum of the buckets")
    return DecodedState(bucket_ms, buckets)


def pending_field(t_ms: int, bucket_ms: int) -> int:
    """The pending-window field of a reservation admitted at ``t_ms``.

    Args:
        t_ms: the admission instant (the Redis clock).
        bucket_ms: the policy's bucket width.

    Returns:
        The last millisecond of the bucket holding ``t_ms``.
    """
    return t_ms - t_ms % bucket_ms + bucket_ms - 1


def decode_pending(
    fields: Mapping[bytes, bytes | str | int] | Mapping[str, bytes | str | int], bucket_ms: int
) -> dict[int, int]:
    """Read a pending-window hash (either version) as buckets of ``bucket_ms``.

    Args:
        fields: the hash (``HGETALL``): a bucket's last millisecond -> amount (and, in a
            version-2 hash, ``PENDING_TOTAL_FIELD`` and the reservations' entries, skipped).
        bucket_ms: the width to read it in; a field written in another width lands in
            the bucket holding its last millisecond.

    Returns:
        Bucket start -> pending amount, zero sums dropped.
    """
    buckets: dict[int, int] = {}
    for field, value in fields.items():
        if not field.isdigit():  # the version-2 sum and reservation entries
            continue
        last = int(field)
        start = last - last % bucket_ms
        buckets[start] = buckets.get(start, 0) + int(value)
    return {start: amount for start, amount in buckets.items() if amount}


def read(raw: bytes | None, bucket_ms: int | None) -> dict[int, int]:
    """The absorbed window a Redis string holds, in buckets of ``bucket_ms``: what every
    reader counts (the admit script's ``window_decode`` reads it the same way).

    Args:
        raw: the value (``GET``), None or empty for a missing key (an empty window).
        bucket_ms: the policy's bucket width now; a value written in another width (the
            policy's bucket changed since) is moved as ``windows.rebucket`` does. None:
            the buckets as written.

    Raises:
        ValueError: the bytes are not a valid value (see :func:`decode`).
    """
    if not raw:
        return {}
    decoded = decode(raw)
    if bucket_ms is not None and decoded.bucket_ms != bucket_ms:
        return rebucket(decoded.buckets, decoded.bucket_ms, bucket_ms)
    return decoded.buckets


def pending_fields(*hashes: Mapping[bytes | str, bytes | str | int]) -> dict[str, int]:
    """Several pending-window hashes (``HGETALL`` of each version's) as one: each field's
    amounts summed, the version-2 total skipped. What :func:`decode_pending` reads."""
    out: dict[str, int] = {}
    for fields in hashes:
        for field, value in fields.items():
            name = field.decode() if isinstance(field, bytes) else field
            if name.isdigit():  # bucket fields: not the sum, nor the entries
                out[name] = out.get(name, 0) + int(value)
    return out


def read_held(
    raw: bytes | None, bucket_ms: int, *pending: Mapping[bytes | str, bytes | str | int]
) -> dict[int, int]:
    """A key's absorbed window plus its pending windows (``HGETALL`` of each version's
    hash), bucket by bucket: what the admit script counts."""
    return merge(read(raw, bucket_ms), decode_pending(pending_fields(*pending), bucket_ms))
