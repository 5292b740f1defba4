"""The report of ``spendgate simulate``: per draft policy and key, JSON, the chart."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spendgate.schemas.policies import Policy

__all__ = [
    "HIGH_WATER",
    "SERIES_POINTS",
    "KeyReport",
    "PolicyReport",
    "Report",
    "Tally",
    "chart",
    "dumps",
    "iso_ms",
    "track",
]

SERIES_POINTS = 4000
#: The share of the limit "time over" is measured against.
HIGH_WATER = 0.8


@dataclass(kw_only=True)
class Tally:
    """Requests seen, refused (how many, which units, first and last time) and capped."""

    requests: int = 0
    refused: int = 0
    refused_units: int = 0
    capped: int = 0
    first_refusal: datetime | None = None
    last_refusal: datetime | None = None

    def refuse(self, at: datetime, units: int) -> None:
        """Count one refusal of ``units`` at ``at``."""
        self.refused += 1
        self.refused_units += units
        self.first_refusal = self.first_refusal or at
        self.last_refusal = at

    def tally_json(self) -> dict[str, Any]:
        """The counts as JSON values."""
        return {
            "requests": self.requests,
            "refused": self.refused,
            "refused_share": self.refused / self.requests if self.requests else 0.0,
            "refused_units": self.refused_units,
            "capped": self.capped,
            "first_refusal": _iso(self.first_refusal),
            "last_refusal": _iso(self.last_refusal),
        }


@dataclass
class KeyReport(Tally):
    """One draft budget key over the history."""

    policy: str
    key: str
    limit: int
    peak_used: int = 0
    over_high_s: float = 0.0
    #: (ms, window total after the request, refused) at each judged request, for the chart.
    series: list[tuple[int, int, bool]] = field(default_factory=list, repr=False)
    _high_since: int | None = field(default=None, repr=False)
    _last_ms: int = field(default=0, repr=False)

    @property
    def peak_utilization(self) -> float:
        """The highest window total seen at a request, as a share of the limit."""
        return self.peak_used / self.limit

    def to_json(self) -> dict[str, Any]:
        """The key's figures as JSON values."""
        return {
            "policy": self.policy,
            "key": self.key,
            "limit": self.limit,
            **self.tally_json(),
            "peak_used": self.peak_used,
            "peak_utilization": round(self.peak_utilization, 6),
            "seconds_over_80pct": round(self.over_high_s, 3),
        }


@dataclass
class PolicyReport(Tally):
    """One draft policy over the history: requests it saw, refused, when."""

    policy: Policy
    #: Requests this policy refused at first that were admitted after a wait (``delay``)
    #: or with the model or pool replaced (``downgrade``, ``route``).
    delayed: int = 0
    replaced: int = 0
    keys: dict[str, KeyReport] = field(default_factory=dict)

    def top_keys(self, n: int) -> list[KeyReport]:
        """The ``n`` keys with the most refusals, then the highest peak."""
        ranked = sorted(self.keys.values(), key=lambda k: (-k.refused, -k.peak_utilization, k.key))
        return ranked[:n]

    def to_json(self, top: int) -> dict[str, Any]:
        """The policy's figures as JSON values, with its top keys."""
        peak = max((k.peak_utilization for k in self.keys.values()), default=0.0)
        return {
            "policy": self.policy.id,
            "unit": self.policy.unit,
            "limit": self.policy.limit,
            "window": self.policy.window,
            **self.tally_json(),
            "delayed": self.delayed,
            "downgraded_or_routed": self.replaced,
            "peak_utilization": round(peak, 6),
            "seconds_over_80pct": round(sum(k.over_high_s for k in self.keys.values()), 3),
            "keys": len(self.keys),
            "top_keys": [k.to_json() for k in self.top_keys(top)],
        }


@dataclass
class Report:
    """What ``simulate`` found: per draft policy and key, plus what the history held."""

    policies: dict[str, PolicyReport]
    usage_records: int = 0
    refusal_records: int = 0
    #: Requests judged: admitted reserves plus first refusals of a request id.
    requests: int = 0
    #: Refusals repeating a request id already seen (a retry: counted once).
    repeated_refusals: int = 0
    #: Requests matching no draft policy.
    unmatched: int = 0
    #: Requests that could not be judged (a group_by field missing, a unit error).
    unjudged: int = 0
    #: Commit / extend / release events dropped because the draft refused their request.
    dropped_settlements: int = 0
    #: Refusals admission dropped before publishing (history incomplete there), from the
    #: gap records on the refusals topic; None: none recorded (drops at an admission
    #: process's shutdown are only in ``spendgate_admission_refusals_total``).
    dropped_at_publish: int | None = None
    first_ms: int | None = None
    last_ms: int | None = None
    seconds: float = 0.0
    #: Draft budget keys whose windows the fold kept.
    keys_folded: int = 0

    def to_json(self, top: int = 10) -> dict[str, Any]:
        """The whole report as JSON values."""
        return {
            "from": iso_ms(self.first_ms),
            "to": iso_ms(self.last_ms),
            "usage_records": self.usage_records,
            "refusal_records": self.refusal_records,
            "requests": self.requests,
            "repeated_refusals": self.repeated_refusals,
            "unmatched_requests": self.unmatched,
            "unjudged_requests": self.unjudged,
            "dropped_settlements": self.dropped_settlements,
            "keys_folded": self.keys_folded,
            "refusals_dropped_at_publish": self.dropped_at_publish,
            "policies": [p.to_json(top) for p in self.policies.values()],
        }


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat().replace("+00:00", "Z")


def iso_ms(ms: int | None) -> str | None:
    return None if ms is None else _iso(datetime.fromtimestamp(ms / 1000, UTC))


def track(kr: KeyReport, at_ms: int, used: int, refused: bool) -> None:
    """Peak, time over 80% (between consecutive requests on the key) and the chart's series."""
    if kr._high_since is not None:
        kr.over_high_s += max(0, at_ms - kr._last_ms) / 1000
    kr._last_ms = at_ms
    kr._high_since = at_ms if used >= HIGH_WATER * kr.limit else None
    kr.peak_used = max(kr.peak_used, used)
    kr.series.append((at_ms, used, refused))
    if len(kr.series) > SERIES_POINTS:
        # Keep every refusal, thin the rest by half.
        kr.series = [p for n, p in enumerate(kr.series) if p[2] or n % 2 == 0]


def chart(report: Report, path: str, top: int = 4) -> None:
    """A PNG of the top keys' windows against the draft limit, would-be refusals marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import dates

    keys = [k for p in report.policies.values() for k in p.top_keys(top)]
    keys = sorted(keys, key=lambda k: (-k.refused, -k.peak_utilization))[:top]
    fig, ax = plt.subplots(figsize=(10, 5))
    for k in keys:
        if not k.series:
            continue
        xs = dates.date2num([datetime.fromtimestamp(t / 1000, UTC) for t, _, _ in k.series])  # type: ignore[no-untyped-call]
        ys = [100 * used / k.limit for _, used, _ in k.series]
        (line,) = ax.plot(xs, ys, label=f"{k.key} ({k.refused} refused)", linewidth=1)
        hit = [n for n, point in enumerate(k.series) if point[2]]
        if hit:
            ax.scatter(
                [xs[n] for n in hit],
                [ys[n] for n in hit],
                color=line.get_color(),
                marker="x",
                s=18,
            )
    ax.axhline(100, color="red", linestyle="--", linewidth=1, label="draft limit")
    ax.set_ylabel("window used (% of the draft limit)")
    ax.set_title("spendgate simulate: top keys under the draft (x = would be refused)")
    ax.legend(loc="upper left", fontsize="small")
    ax.xaxis_date()
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dumps(report: Report, top: int = 10) -> str:
    """The report as indented JSON."""
    return json.dumps(report.to_json(top), indent=2)
