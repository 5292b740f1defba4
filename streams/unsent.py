"""The alerts a partition raised that the broker has not acked yet, kept in the table (pure).

An alert is raised by the table write that records its crossing; from then on the crossing
will not raise it again. So it is kept beside that write, under :func:`unsent_key` in the
same changelog partition, until the broker acks it: a worker that dies in between (its
table restored from the changelog, here or on another worker) finds it there and sends it
with the partition's next batch. Its id is deterministic, so a copy sent twice is dropped by
id downstream.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from spendgate.schemas.alerts import Alert

__all__ = ["UNSENT_PREFIX", "decode_alerts", "encode_alerts", "unsent_key"]

#: Table keys of the unsent alerts start with this; a budget key never does (it starts with
#: a policy id, ``[a-z0-9._-]``).
UNSENT_PREFIX = "~unsent|"


def unsent_key(topic: str, partition: int) -> str:
    """The table key of the alerts ``topic``'s ``partition`` raised and the broker has not
    acked yet."""
    return f"{UNSENT_PREFIX}{topic}|{partition}"


def encode_alerts(alerts: Iterable[Alert]) -> bytes:
    """The table value of ``alerts`` (a JSON list; ``b""`` when there are none)."""
    items = [a.model_dump(mode="json") for a in alerts]
    return orjson.dumps(items) if items else b""


def decode_alerts(raw: bytes | None) -> list[Alert]:
    """The alerts a table value holds (none for a missing or empty value)."""
    if not raw:
        return []
    return [Alert.model_validate(item) for item in orjson.loads(raw)]
