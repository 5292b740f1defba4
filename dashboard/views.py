"""What the dashboard shows, computed from what Redis and the metrics hold (no I/O here)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from spendgate.schemas import window_codec, windows
from spendgate.schemas.forecast import forecast
from spendgate.schemas.matching import parse_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.shards import tenant_of
from spendgate.schemas.windows import WindowSpec

#: The decision kinds admission counts (``spendgate_admission_decisions_total``).
REFUSED = ("reject",)


def spec_of(policy: Policy) -> WindowSpec:
    """The policy's window as the window functions want it."""
    return WindowSpec(policy.window_ms, policy.bucket_ms, policy.boundary)


@dataclass(frozen=True, slots=True)
class KeyRow:
    """One budget key as the page's table shows it."""

    policy: str
    key: str
    tenant: str | None
    unit: str
    limit: int
    used: int
    reserved: int
    window_seconds: int
    retry_after_seconds: int
    exhausts_in_seconds: int | None

    @property
    def share(self) -> float:
        """Used plus reserved over the limit (above 1 when over)."""
        return (self.used + self.reserved) / self.limit

    def as_json(self) -> dict[str, Any]:
        """The row for the page (plain JSON values)."""
        return {**asdict(self), "share": round(self.share, 4)}


def held(policy: Policy, window: bytes | None, pending: Mapping[Any, Any], now_ms: int) -> Any:
    """``key``'s absorbed and pending buckets combined at ``now_ms`` (``windows.Held``)."""
    spec = spec_of(policy)
    live = window_codec.decode_pending(pending, spec.bucket_ms)
    return windows.combine(spec, window_codec.read(window, spec.bucket_ms), live, now_ms)


def key_row(
    key: str, policy: Policy, window: bytes | None, pending: Mapping[Any, Any], now_ms: int
) -> KeyRow:
    """The table row of ``key`` at ``now_ms`` (the Redis clock), as admission sees it:
    used (absorbed by the worker), reserved (pending in Redis), when a request of one unit
    fits again (``Retry-After``), and when the budget runs out at its recent rate
    (``exhausts_in``, ``schemas.forecast``)."""
    spec = spec_of(policy)
    h = held(policy, window, pending, now_ms)
    used, reserved = h.used, max(0, h.pending)
    retry = 0
    if used + reserved >= policy.limit:
        fit = windows.retry_after(spec, h.buckets, now_ms, limit=policy.limit, amount=1)
        retry = -1 if fit.fits_at_ms is None else math.ceil((fit.fits_at_ms - now_ms) / 1000)
    # The same forecast as GET /v1/budgets' exhausts_in_seconds (None: not heading there).
    exhausts = forecast(spec, h.buckets, now_ms, limit=policy.limit).exhausts_in_seconds
    _, fields = parse_key(key)
    return KeyRow(
        policy=policy.id,
        key=key,
        tenant=tenant_of(policy, fields),
        unit=policy.unit,
        limit=policy.limit,
        used=used,
        reserved=reserved,
        window_seconds=policy.window_ms // 1000,
        retry_after_seconds=retry,
        exhausts_in_seconds=exhausts,
    )


def window_series(
    policy: Policy, window: bytes | None, pending: Mapping[Any, Any], now_ms: int
) -> dict[str, Any]:
    """A key's window over time for the chart: every bucket of the trailing window (the
    absorbed and the pending amount) and the trailing total at each bucket's end, with
    the limit; times are ms on the Redis clock."""
    spec = spec_of(policy)
    absorbed = window_codec.read(window, spec.bucket_ms)
    pending_b = window_codec.decode_pending(pending, spec.bucket_ms)
    h = held(policy, window, pending, now_ms)
    head = spec.bucket_of(now_ms)
    first = head - spec.window_ms + spec.bucket_ms
    buckets = [
        {
            "start_ms": start,
            "absorbed": absorbed.get(start, 0),
            "pending": pending_b.get(start, 0),
            "total_ms": min(now_ms, start + spec.bucket_ms - 1),
            "total": windows.total(spec, h.buckets, min(now_ms, start + spec.bucket_ms - 1)),
        }
        for start in range(first, head + 1, spec.bucket_ms)
    ]
    return {
        "now_ms": now_ms,
        "bucket_ms": spec.bucket_ms,
        "window_ms": spec.window_ms,
        "limit": policy.limit,
        "buckets": buckets,
    }


@dataclass(frozen=True, slots=True)
class Scrape:
    """One scrape of the admission's and the worker's metrics (counters as read)."""

    at_s: float
    decisions: dict[str, float]
    dead_letters: float | None
    lag_sum: float | None
    lag_count: float | None


def parse_scrape(at_s: float, admission: str | None, worker: str | None) -> Scrape:
    """Read the counters the page shows from Prometheus text (``None``: not scraped)."""
    decisions: dict[str, float] = {}
    for family in text_string_to_metric_families(admission or ""):
        if family.name == "spendgate_admission_decisions":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    kind = sample.labels.get("decision", "")
                    decisions[kind] = decisions.get(kind, 0.0) + sample.value
    dead = lag_sum = lag_count = None
    for family in text_string_to_metric_families(worker or ""):
        for sample in family.samples:
            if sample.name == "spendgate_dead_lettered_total":
                dead = sample.value
            elif sample.name == "spendgate_processing_lag_seconds_sum":
                lag_sum = sample.value
            elif sample.name == "spendgate_processing_lag_seconds_count":
                lag_count = sample.value
    return Scrape(at_s, decisions, dead, lag_sum, lag_count)


def rates(before: Scrape | None, now: Scrape) -> dict[str, Any]:
    """The metrics panel: decisions by kind (totals and per second since the previous
    scrape), refusals per second, the worker's mean lag over the interval, dead letters."""
    span = now.at_s - before.at_s if before is not None else 0.0

    def per_s(new: float | None, old: float | None) -> float | None:
        if new is None or old is None or span <= 0:
            return None
        return max(0.0, new - old) / span

    old = before.decisions if before is not None else {}
    by_kind = {
        kind: {"total": total, "per_s": per_s(total, old.get(kind, 0.0) if before else None)}
        for kind, total in sorted(now.decisions.items())
    }
    refused = sum(now.decisions.get(k, 0.0) for k in REFUSED)
    refused_before = sum(old.get(k, 0.0) for k in REFUSED) if before is not None else None
    lag = None
    if before is not None and None not in (now.lag_sum, now.lag_count, before.lag_sum):
        counted = (now.lag_count or 0.0) - (before.lag_count or 0.0)
        if counted > 0:
            lag = ((now.lag_sum or 0.0) - (before.lag_sum or 0.0)) / counted
    return {
        "decisions": by_kind,
        "refused_total": refused,
        # No decision counted yet (or admission not scraped): no rate to show.
        "refusals_per_s": per_s(refused, refused_before) if now.decisions else None,
        "worker_lag_s": lag,
        "dead_letters": now.dead_letters,
    }
