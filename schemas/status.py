"""Whether the stack can decide: every partition's applied mark, classified (pure).

The answer of ``GET /v1/status`` (``admission.status`` reads Redis and calls
:func:`classify`). A mark field (``schemas.shards``: ``usage:<p>``, ``keyed:<p>``) is
classified exactly as the admit script classifies it (``admission/scripts/admit.lua``):

- ``missing``: no field in the marks hash (no worker vouches for the partition: none ran,
  or Redis lost its data and the worker has not restored and caught up);
- ``stale``: the watermark is older than the staleness bound on the Redis clock
  (``watermark_ms < redis_time_ms - staleness_ms``: the worker is dead, stopped or behind);
- ``vouched``: otherwise.

The stack is *decidable* when every mark of the topology is vouched: only then does no
budget window answer by its policy's failure mode for want of a mark.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spendgate.schemas.shards import Topology

MarkState = Literal["vouched", "stale", "missing"]

__all__ = [
    "MarkState",
    "PartitionStatus",
    "StackStatus",
    "TopologyCounts",
    "WorkerLag",
    "classify",
    "parse_int",
    "parse_lag",
]


class WorkerLag(BaseModel):
    """How far behind its partition the mark's owner was when it last measured."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    records_behind: int = Field(description="Records of the partition not yet applied.")
    measured_at_ms: int = Field(description="When the worker measured it (Redis clock, ms).")
    age_ms: int = Field(description="Redis time minus measured_at_ms: how old the figure is.")


class PartitionStatus(BaseModel):
    """One partition mark of the topology."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    field: str = Field(description="The mark field: `usage:<p>` or `keyed:<p>`.")
    topic: Literal["usage", "keyed"]
    partition: int
    state: MarkState = Field(description="As the admit script classifies it.")
    watermark_ms: int | None = Field(
        description="The applied watermark (ms since the epoch); null when missing."
    )
    age_ms: int | None = Field(
        description=(
            "Redis time minus the watermark; stale beyond `staleness_ms` (negative: the "
            "watermark is ahead of the Redis clock); null when missing."
        )
    )
    lag: WorkerLag | None = Field(
        description="The owner's last progress report; null when none was written."
    )
    owner_token: int | None = Field(
        description="The fencing token of the mark's owner; null when none was issued."
    )


class TopologyCounts(BaseModel):
    """The partition counts the marks refer to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    usage: int
    keyed: int


class StackStatus(BaseModel):
    """The answer of ``GET /v1/status``: can the stack decide, and if not, why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decidable: bool = Field(description="Every mark of the topology is vouched.")
    reason: str | None = Field(description="Why not decidable; null when decidable.")
    redis_time_ms: int = Field(description="The Redis clock (TIME) when read, ms.")
    staleness_ms: int = Field(description="This admission's staleness bound, ms.")
    topology: TopologyCounts | None = Field(
        description="Null when no worker has written the topology yet."
    )
    policies: int = Field(description="Policies materialized in Redis.")
    counts: dict[MarkState, int] = Field(description="Marks per state.")
    partitions: list[PartitionStatus]


def parse_int(raw: bytes | str | None) -> int | None:
    """An integer stored in Redis (``None``, or not a number: ``None``).

    Also reads a number Lua's ``tonumber`` reads in float notation (``"5.0"``, ``"1e3"``).
    """
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    try:
        return int(text)
    except ValueError:
        try:
            return int(float(text))
        except (ValueError, OverflowError):
            return None


def parse_lag(raw: bytes | str | None, now_ms: int) -> WorkerLag | None:
    """A progress value ``"<records behind>:<Redis ms when measured>"``, or ``None``."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    behind, sep, at = text.partition(":")
    records, measured = parse_int(behind), parse_int(at)
    if not sep or records is None or measured is None:
        return None
    return WorkerLag(records_behind=records, measured_at_ms=measured, age_ms=now_ms - measured)


def _where(field: str) -> tuple[Literal["usage", "keyed"], int]:
    topic, _, partition = field.partition(":")
    return ("keyed" if topic == "keyed" else "usage"), int(partition)


def classify(
    *,
    now_ms: int,
    staleness_ms: int,
    topology: Topology | None,
    marks: Mapping[str, bytes | str],
    progress: Mapping[str, bytes | str],
    owners: Mapping[str, bytes | str],
    policies: int = 0,
) -> StackStatus:
    """Classify every mark of ``topology`` as the admit script does.

    Args:
        now_ms: the Redis clock (``TIME``, seconds * 1000 + micros // 1000, as the script).
        staleness_ms: the admission's staleness bound.
        topology: the partition counts (``None``: no worker wrote them yet).
        marks: the marks hash (field -> watermark ms).
        progress: the progress hash (field -> ``"<records behind>:<ms>"``).
        owners: the fencing tokens hash (field -> token).
        policies: how many policies are materialized.
    """
    counts: dict[MarkState, int] = {"vouched": 0, "stale": 0, "missing": 0}
    if topology is None:
        return StackStatus(
            decidable=False,
            reason=(
                "no topology in Redis: no worker has started on this Redis prefix yet (or "
                "Redis lost its data); every window is missing"
            ),
            redis_time_ms=now_ms,
            staleness_ms=staleness_ms,
            topology=None,
            policies=policies,
            counts=counts,
            partitions=[],
        )
    oldest = now_ms - staleness_ms
    rows: list[PartitionStatus] = []
    for field in topology.all_marks():
        watermark = parse_int(marks.get(field))
        state: MarkState
        if watermark is None:
            state = "missing"
        elif watermark < oldest:
            state = "stale"
        else:
            state = "vouched"
        counts[state] += 1
        topic, partition = _where(field)
        rows.append(
            PartitionStatus(
                field=field,
                topic=topic,
                partition=partition,
                state=state,
                watermark_ms=watermark,
                age_ms=None if watermark is None else now_ms - watermark,
                lag=parse_lag(progress.get(field), now_ms),
                owner_token=parse_int(owners.get(field)),
            )
        )
    unvouched = [r for r in rows if r.state != "vouched"]
    reason = None
    if unvouched:
        shown = ", ".join(f"{r.field} {r.state}" for r in unvouched[:8])
        more = f" and {len(unvouched) - 8} more" if len(unvouched) > 8 else ""
        reason = (
            f"{len(unvouched)} of {len(rows)} marks not vouched ({shown}{more}): windows "
            "depending on them answer by their policy's failure mode"
        )
    return StackStatus(
        decidable=not unvouched,
        reason=reason,
        redis_time_ms=now_ms,
        staleness_ms=staleness_ms,
        topology=TopologyCounts(usage=topology.usage, keyed=topology.keyed),
        policies=policies,
        counts=counts,
        partitions=rows,
    )
