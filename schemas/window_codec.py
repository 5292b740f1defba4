"""Compact binary layout of one budget key's buckets, shared by RocksDB values and Redis.

The same bytes are a RocksDB table value in the stream processor and a Redis string
that the admission Lua script decodes with ``struct.unpack`` (``schemas/window.lua``).
All integers are little-endian. Layout, version 1::

    offset size  type  field
    0      1     u8    version, always 1
    1      1     u8    kind: 0 = sparse, 1 = dense
    2      4     u32   bucket_ms (1 .. 2**32 - 1)
    6      8     i64   base_ms: start of the oldest non-empty bucket (0 when empty)
    14     4     u32   n: number of entries that follow
    18     ...         body

    sparse body: n entries of 12 bytes, offsets strictly increasing
      +0   4     u32   offset: the bucket starts at base_ms + offset * bucket_ms
      +4   8     i64   amount (non-zero)
    dense body: n slots of 8 bytes; slot i is the bucket at base_ms + i * bucket_ms
      +0   8     i64   amount, 0 for an empty bucket (first and last slot non-zero)

``encode`` picks whichever body is smaller (dense when ``8 * span <= 12 * n``, with
``span`` the buckets from the oldest to the newest non-empty one). The empty state is
the 18-byte header with ``n = 0``. Sizes: a dense 24 h window of 1 min buckets (1440
non-empty buckets) is 11,538 bytes; 60 sparse buckets are 738 bytes.

Lua numbers are doubles, exact to 2**53, so ``encode`` refuses a state whose absolute
amounts sum to more than ``MAX_SAFE_AMOUNT``: every partial sum the Lua side forms
(totals, prorated shares) then stays exact.

The *pending window* (reservations admission holds that the processor has not absorbed)
is a Redis hash instead, updated in place by the scripts with ``HINCRBY``: field = the
decimal *last* millisecond of the bucket a reservation was admitted in
(``pending_field``), value = the amount pending there. Naming a bucket by its last
millisecond lets a reader in any bucket width place it as ``schemas.windows.rebucket``
would (``decode_pending``), so a policy whose ``bucket`` changed needs no rewrite.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import NamedTuple

from spendgate.schemas.windows import merge, rebucket

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KIND_DENSE",
    "KIND_SPARSE",
    "MAX_SAFE_AMOUNT",
    "DecodedState",
    "decode",
    "decode_pending",
    "encode",
    "pending_field",
    "read",
    "read_held",
]

FORMAT_VERSION = 1
KIND_SPARSE = 0
KIND_DENSE = 1
#: Largest integer a double (a Lua number in Redis) holds exactly.
MAX_SAFE_AMOUNT = 2**53 - 1

_HEADER = struct.Struct("<BBIqI")
_PAIR = struct.Struct("<Iq")
_U32_MAX = 2**32 - 1
_I64_MAX = 2**63 - 1
HEADER_SIZE = _HEADER.size


class DecodedState(NamedTuple):
    """A decoded value: the bucket width it was written with and its buckets."""

    bucket_ms: int
    buckets: dict[int, int]


def encode(buckets: Mapping[int, int], bucket_ms: int) -> bytes:
    """Encode buckets (start ms -> amount) in the compact layout.

    Zero amounts are skipped.

    Args:
        buckets: bucket start (a non-negative multiple of ``bucket_ms``) -> amount.
        bucket_ms: the bucket width.

    Returns:
        The encoded bytes, sparse or dense, whichever is smaller.

    Raises:
        ValueError: ``bucket_ms`` does not fit a u32, a start is negative or not aligned,
            the buckets span more than 2**32 buckets, or the absolute amounts sum to more
            than ``MAX_SAFE_AMOUNT`` (Lua could not add them exactly).
    """
    if not 1 <= bucket_ms <= _U32_MAX:
        raise ValueError(f"bucket_ms: {bucket_ms} must be between 1 and {_U32_MAX}")
    items = sorted((start, amount) for start, amount in buckets.items() if amount)
    if not items:
        return _HEADER.pack(FORMAT_VERSION, KIND_SPARSE, bucket_ms, 0, 0)
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
    span = last + 1
    if 8 * span <= 12 * len(items):
        slots = [0] * span
        for start, amount in items:
            slots[(start - base) // bucket_ms] = amount
        header = _HEADER.pack(FORMAT_VERSION, KIND_DENSE, bucket_ms, base, span)
        return header + struct.pack(f"<{span}q", *slots)
    body = b"".join(_PAIR.pack((start - base) // bucket_ms, amount) for start, amount in items)
    return _HEADER.pack(FORMAT_VERSION, KIND_SPARSE, bucket_ms, base, len(items)) + body


def decode(data: bytes) -> DecodedState:
    """Decode bytes written by ``encode``.

    Args:
        data: the encoded value.

    Returns:
        The bucket width and the non-empty buckets.

    Raises:
        ValueError: the bytes are not a valid version-1 value (wrong version or kind,
            truncated or trailing bytes, unordered sparse offsets, a zero sparse amount).
    """
    if len(data) < HEADER_SIZE:
        raise ValueError(f"window state: {len(data)} bytes is shorter than the header")
    version, kind, bucket_ms, base, count = _HEADER.unpack_from(data)
    if version != FORMAT_VERSION:
        raise ValueError(f"window state: unknown format version {version}")
    if bucket_ms == 0:
        raise ValueError("window state: bucket_ms is 0")
    body = len(data) - HEADER_SIZE
    buckets: dict[int, int] = {}
    if kind == KIND_DENSE:
        if body != 8 * count:
            raise ValueError(f"window state: dense body of {body} bytes for {count} slots")
        for index, amount in enumerate(struct.unpack_from(f"<{count}q", data, HEADER_SIZE)):
            if amount:
                buckets[base + index * bucket_ms] = amount
        return DecodedState(bucket_ms, buckets)
    if kind != KIND_SPARSE:
        raise ValueError(f"window state: unknown kind {kind}")
    if body != _PAIR.size * count:
        raise ValueError(f"window state: sparse body of {body} bytes for {count} entries")
    previous = -1
    for offset, amount in _PAIR.iter_unpack(data[HEADER_SIZE:]):
        if offset <= previous or not amount:
            raise ValueError("window state: sparse offsets must increase and amounts be non-zero")
        previous = offset
        buckets[base + offset * bucket_ms] = amount
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
    fields: Mapping[bytes | str, bytes | str | int], bucket_ms: int
) -> dict[int, int]:
    """Read a pending-window hash as buckets of ``bucket_ms``.

    Args:
        fields: the hash (``HGETALL``): a bucket's last millisecond -> amount.
        bucket_ms: the width to read it in; a field written in another width lands in
            the bucket holding its last millisecond.

    Returns:
        Bucket start -> pending amount, zero sums dropped.
    """
    buckets: dict[int, int] = {}
    for field, value in fields.items():
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


def read_held(
    raw: bytes | None, pending: Mapping[bytes | str, bytes | str | int], bucket_ms: int
) -> dict[int, int]:
    """A key's absorbed window plus its pending window (``HGETALL``), bucket by bucket:
    what the admit script counts."""
    return merge(read(raw, bucket_ms), decode_pending(pending, bucket_ms))
