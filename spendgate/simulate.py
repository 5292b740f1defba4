"""``spendgate simulate``: replay the usage and refusals history against draft policies.

Nothing is written anywhere: the topics are read with manually assigned consumers (no group,
no committed offsets), the windows live in this process, Redis is never opened.

How a history becomes a counterfactual (the same pure fold as ``replay``,
``streams.fold.fold_usage``, keeps every draft key's windows):

* ``budget.usage`` and ``budget.refusals`` are read from ``--from`` (default: the beginning)
  to their current ends and merged by event time (``occurred_at`` / ``at``; ties keep topic
  order), records after ``--to`` left out.
* Each request — an admitted ``reserve``, or a refusal (the first one of its
  ``request_id``; a retry is not new demand) — is judged at its instant against every
  matching draft policy at once, as the admit script judges: a key fits when its window
  total (everything folded so far, reservations included) plus the request's amount is
  within the limit; ``observe`` policies never refuse; an ``enforce`` policy that does not
  fit refuses the whole request (nothing is charged anywhere) unless it is a ``cap``
  policy whose unit depends on output tokens and some output still fits every key: then
  the request is admitted with its output capped (:func:`judge`).
* A request the draft refuses contributes nothing afterwards: its reserve is not folded,
  and its commit, extends and release are dropped. A capped request's reserve and commit
  are folded with their output tokens at most the cap. An admitted refusal (refused live,
  admitted by the draft) is folded as a reservation of its estimate that nothing settles:
  it stays charged, as an abandoned reservation does at expiry. Commits without a
  reservation and adjusts are folded as they happened.
* ``delay``: a request refused only by delay policies is admitted at the instant it fits
  (the exact Retry-After over the windows as they stand, no new usage assumed) when that
  lies within the smallest ``max_delay`` among them, judged again there, and charged at
  that instant; ``downgrade``/``route``: a request refused only by policies offering an
  alternative is judged again for each alternative subject (model or pool replaced) in
  order, never chained; the first that fits is admitted and it, its commit, extends and
  release are charged to the replaced subject.
* Drafts with a ``burst`` are refused with a message: this version does not simulate it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer

from admission.decide import Charge, Plan, Planner
from schemas.events import Subject, Usage
from schemas.exceptions import SpendgateError
from schemas.fastdecode import decode
from schemas.policies import Policy
from schemas.prices import PriceCatalog
from schemas.refusals import RefusalGap
from schemas.windows import WindowSpec, retry_after, total
from streams.dedupe import IdStore
from streams.fold import Rules, UsageRecord, fold_usage
from streams.kafka_util import assign, partitions, stop
from streams.ledger import KeyState
from streams.settings import WorkerSettings

__all__ = [
    "KeyReport",
    "PolicyReport",
    "Report",
    "Verdict",
    "judge",
    "run_simulation",
    "simulate",
    "unsupported",
]

Progress = Callable[[int, int], None]

#: Points kept per key for the chart (older ones are thinned out beyond this).
SERIES_POINTS = 4000
#: The share of the limit "time over" is measured against.
HIGH_WATER = 0.8


def unsupported(policies: Sequence[Policy]) -> list[str]:
    """Why each draft this version cannot simulate is refused (empty: all can be)."""
    out = []
    for p in policies:
        if getattr(p, "burst", None) is not None:
            out.append(f"{p.id}: burst is not simulated yet")
    return out


@dataclass(frozen=True, slots=True)
class Verdict:
    """How the draft judges one request: refused (by ``violated``), or admitted with the
    output capped at ``max_output_tokens`` (None: as asked)."""

    refused: bool
    violated: tuple[str, ...] = ()
    max_output_tokens: int | None = None
    #: Per charge: the amount the request holds (its capped amount when capped).
    amounts: tuple[int, ...] = ()
    #: ``delay``: the instant it was admitted after being held (None: at once).
    admitted_ms: int | None = None
    #: ``downgrade``/``route``: the subject field replaced and its value (None: as asked).
    replaced: tuple[str, str] | None = None


def _amount_at(charge: Charge, output: int | None, asked: int) -> int:
    cap = charge.cap
    if output is None or cap.r == 0:
        return asked
    return -((-(cap.s + output * cap.r)) // cap.d)


def judge(charges: Sequence[Charge], totals: Sequence[int], estimate_output: int) -> Verdict:
    """Judge one request as the admit script does, all matching policies at once.

    Args:
        charges: the request's keys and amounts (``admission.decide.Planner.charges``).
        totals: each key's window total at the request's instant.
        estimate_output: the estimate's output tokens (what a cap lowers).
    """
    amounts = [c.amount for c in charges]
    over = [
        i
        for i, c in enumerate(charges)
        if c.target.policy.mode == "enforce" and totals[i] + amounts[i] > c.target.policy.limit
    ]
    if not over:
        return Verdict(False, (), None, tuple(amounts))
    refusing = tuple(sorted({charges[i].target.policy.id for i in over}))
    if any(charges[i].target.policy.on_exceed != "cap" or charges[i].cap.r == 0 for i in over):
        return Verdict(True, refusing)
    # The largest output every capped key (and every other enforced key) still fits.
    output = estimate_output
    for i, c in enumerate(charges):
        if c.target.policy.mode != "enforce" or c.cap.r == 0:
            continue
        room = c.target.policy.limit - totals[i]
        output = min(output, (room * c.cap.d - c.cap.s) // c.cap.r)
    if output < 0:
        return Verdict(True, refusing)
    capped = [_amount_at(c, output, amounts[i]) for i, c in enumerate(charges)]
    if any(
        c.target.policy.mode == "enforce" and totals[i] + capped[i] > c.target.policy.limit
        for i, c in enumerate(charges)
    ):
        return Verdict(True, refusing)
    return Verdict(False, (), output, tuple(capped))


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
            "from": _iso_ms(self.first_ms),
            "to": _iso_ms(self.last_ms),
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


def _iso_ms(ms: int | None) -> str | None:
    return None if ms is None else _iso(datetime.fromtimestamp(ms / 1000, UTC))


class _Merged:
    """One record of either topic, in the merged order."""

    __slots__ = ("at_ms", "broker_ms", "order", "topic", "value")

    def __init__(self, at_ms: int, order: int, topic: int, broker_ms: int, value: bytes) -> None:
        self.at_ms = at_ms
        self.order = order
        self.topic = topic
        self.broker_ms = broker_ms
        self.value = value


def _event_ms(topic: int, value: bytes, broker_ms: int) -> int:
    """A record's event time (``occurred_at`` or ``at``); the broker's when unreadable."""
    try:
        if topic == 0:
            return decode(value).occurred_ms
        raw = orjson.loads(value)
        return int(datetime.fromisoformat(raw["at"].replace("Z", "+00:00")).timestamp() * 1000)
    except Exception:  # noqa: BLE001 - unreadable records keep their broker time
        return broker_ms


class Simulation:
    """The draft's state over the merged history (pure: records in, report out).

    Args:
        draft: the draft policies.
        prices: the price catalog for ``cost_usd`` drafts.
        dedupe_horizon_ms: the producer-duplicate horizon (as the worker's).
    """

    def __init__(
        self, draft: Sequence[Policy], prices: PriceCatalog | None, dedupe_horizon_ms: int
    ) -> None:
        self.planner = Planner(list(draft), prices)
        self.rules = Rules(draft, prices, local=lambda policy: True)
        self.specs = {p.id: WindowSpec(p.window_ms, p.bucket_ms, p.boundary) for p in draft}
        self.states: dict[str, KeyState] = {}
        self.ids = IdStore(None, dedupe_horizon_ms)
        self.report = Report({p.id: PolicyReport(policy=p) for p in draft})
        self.refused_reservations: set[str] = set()
        #: reservation id -> the output cap the draft put on it.
        self.capped: dict[str, int] = {}
        #: reservation id -> the subject field (and value) a downgrade or route replaced.
        self.replaced: dict[str, tuple[str, str]] = {}
        self.seen_refusals: set[str] = set()
        self._offset = 0
        self._broker_ms = 0

    def close(self) -> None:
        """Release the dedupe set's temporary folder."""
        self.ids.close()

    def _load(self, key: str) -> KeyState:
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = KeyState()
        return state

    def _fold(self, value: bytes, broker_ms: int) -> None:
        # Positions are the merged order's (one partition): the ledger applies each once.
        self._broker_ms = max(self._broker_ms, broker_ms)
        rec = UsageRecord(0, self._offset, self._broker_ms, value)
        self._offset += 1
        result = fold_usage(
            [rec],
            self._load,
            self.rules,
            max_future_skew_ms=300_000,
            max_value_bytes=1 << 30,
            ids=self.ids,
        )
        for write in result.writes:
            self.states[write.key] = write.state

    def feed(self, item: _Merged) -> None:
        """Judge and fold one record of the merged history."""
        report = self.report
        report.first_ms = item.at_ms if report.first_ms is None else report.first_ms
        report.last_ms = item.at_ms
        if item.topic == 1:
            self._refusal(item)
            return
        report.usage_records += 1
        try:
            event = decode(item.value)
        except Exception:  # noqa: BLE001 - the fold dead-letters it as the worker does
            self._fold(item.value, item.broker_ms)
            return
        rid = event.reservation_id
        if event.kind == "reserve" and rid is not None:
            usage = Usage.model_validate(_usage_dict(event.usage))
            subject = _subject(event.subject)
            verdict = self._judge(subject, usage, event.occurred_ms)
            if verdict is None or not verdict.refused:
                value = item.value
                if verdict is not None:
                    if verdict.max_output_tokens is not None:
                        self.capped[rid] = verdict.max_output_tokens
                    if verdict.replaced is not None:
                        self.replaced[rid] = verdict.replaced
                    value = _rewritten(value, verdict)
                self._fold(value, item.broker_ms)
            else:
                self.refused_reservations.add(rid)
            return
        if rid is not None and rid in self.refused_reservations:
            report.dropped_settlements += 1
            return
        value = item.value
        if rid is not None and (rid in self.capped or rid in self.replaced):
            cap = self.capped.get(rid) if event.kind == "commit" else None
            value = _rewritten(value, Verdict(False, (), cap, (), None, self.replaced.get(rid)))
        self._fold(value, item.broker_ms)

    def _refusal(self, item: _Merged) -> None:
        try:
            raw = orjson.loads(item.value)
            if raw.get("kind") == "gap":
                gap = RefusalGap.model_validate(raw)
                known = self.report.dropped_at_publish or 0
                self.report.dropped_at_publish = known + gap.dropped
                return
            self.report.refusal_records += 1
            request_id = str(raw["request_id"])
            subject = Subject.model_validate(raw["subject"])
            usage = Usage.model_validate(raw["estimate"])
        except Exception:  # noqa: BLE001 - not a refusal record: nothing to judge
            return
        if request_id in self.seen_refusals:
            self.report.repeated_refusals += 1
            return
        self.seen_refusals.add(request_id)
        verdict = self._judge(subject, usage, item.at_ms)
        if verdict is not None and verdict.refused:
            return
        # Admitted by the draft: its estimate is held from its instant and never settled.
        body = {
            "event_id": f"simulated-{request_id}",
            "kind": "reserve",
            "subject": subject.model_dump(exclude_none=True),
            "occurred_at": _iso_ms(item.at_ms),
            "reservation_id": f"simulated-{request_id}",
            "usage": usage.model_dump(exclude_none=True),
            "expires_at": _iso_ms(item.at_ms + 1),
        }
        value = orjson.dumps(body)
        if verdict is not None:
            value = _rewritten(value, verdict)
        self._fold(value, item.broker_ms)

    def _judge(self, subject: Subject, usage: Usage, at_ms: int) -> Verdict | None:
        """Judge a request at ``at_ms``; None when no draft policy matches it (or it
        cannot be judged); the report is updated."""
        report = self.report
        report.requests += 1
        try:
            plans = self.planner.plans(subject, usage)
        except SpendgateError:
            report.unjudged += 1
            return None
        charges = plans[0].charges
        if not charges:
            report.unmatched += 1
            return None
        totals = self._totals(charges, at_ms)
        first = verdict = judge(charges, totals, usage.output_tokens)
        if verdict.refused:
            verdict = self._delayed(charges, verdict, usage, at_ms) or self._alternative(
                plans, verdict, usage, at_ms
            )
        at = datetime.fromtimestamp(at_ms / 1000, UTC)
        if first.refused and not verdict.refused:
            for pid in first.violated:
                pr = report.policies[pid]
                if verdict.admitted_ms is not None:
                    pr.delayed += 1
                else:
                    pr.replaced += 1
        for i, c in enumerate(charges):
            policy = c.target.policy
            pr = report.policies[policy.id]
            kr = pr.keys.get(c.target.key)
            if kr is None:
                kr = pr.keys[c.target.key] = KeyReport(
                    policy=policy.id, key=c.target.key, limit=policy.limit
                )
            pr.requests += 1
            kr.requests += 1
            refused_here = verdict.refused and policy.id in verdict.violated
            held_here = not verdict.refused and verdict.replaced is None
            used_after = totals[i] + (verdict.amounts[i] if held_here else 0)
            _track(kr, at_ms, used_after, refused_here)
            if refused_here:
                pr.refuse(at, c.amount)
                kr.refuse(at, c.amount)
            elif verdict.max_output_tokens is not None and verdict.amounts[i] < c.amount:
                pr.capped += 1
                kr.capped += 1
        return verdict

    def _totals(self, charges: Sequence[Charge], at_ms: int) -> list[int]:
        out = []
        for c in charges:
            state = self.states.get(c.target.key)
            spec = self.specs[c.target.policy.id]
            out.append(total(spec, state.buckets, at_ms) if state is not None else 0)
        return out

    def _delayed(
        self, charges: Sequence[Charge], refused: Verdict, usage: Usage, at_ms: int
    ) -> Verdict | None:
        """``delay``: refused only by delay policies, and every one of them fits within
        the smallest ``max_delay`` among them (assuming no new usage, as admission's
        exact Retry-After does): judged again at that instant."""
        violating = [c for c in charges if c.target.policy.id in refused.violated]
        policies = [c.target.policy for c in violating]
        if any(p.on_exceed != "delay" or p.mode != "enforce" for p in policies):
            return None
        wait_ms = min(p.max_delay_ms for p in policies)
        fits = []
        for c in violating:
            state = self.states.get(c.target.key)
            buckets = state.buckets if state is not None else {}
            spec = self.specs[c.target.policy.id]
            found = retry_after(spec, buckets, at_ms, limit=c.target.policy.limit, amount=c.amount)
            if found.fits_at_ms is None:
                return None
            fits.append(found.fits_at_ms)
        then = max(fits)
        if then - at_ms > wait_ms:
            return None
        again = judge(charges, self._totals(charges, then), usage.output_tokens)
        if again.refused:
            return None
        return Verdict(False, (), again.max_output_tokens, again.amounts, then)

    def _alternative(
        self, plans: Sequence[Plan], refused: Verdict, usage: Usage, at_ms: int
    ) -> Verdict:
        """``downgrade``/``route``: refused only by policies offering an alternative, the
        alternatives are tried in order (never chained); the first that fits wins."""
        violating = [c for c in plans[0].charges if c.target.policy.id in refused.violated]
        if not violating or any(c.alt == 0 for c in violating):
            return refused
        for index in sorted({c.alt for c in violating}):
            plan = plans[index]
            again = judge(plan.charges, self._totals(plan.charges, at_ms), usage.output_tokens)
            if not again.refused:
                name = "model" if plan.kind == "downgrade" else "pool"
                value = plan.subject.value(name) or ""
                return Verdict(
                    False, (), again.max_output_tokens, again.amounts, None, (name, value)
                )
        return refused


def _track(kr: KeyReport, at_ms: int, used: int, refused: bool) -> None:
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


def _subject(subject: object) -> Subject:
    if isinstance(subject, Subject):
        return subject
    fields = {
        name: getattr(subject, name, None)
        for name in Subject.model_fields
        if getattr(subject, name, None) is not None
    }
    return Subject.model_validate(fields)


def _usage_dict(usage: object) -> dict[str, Any]:
    if usage is None:
        return {}
    return {
        name: getattr(usage, name)
        for name in Usage.model_fields
        if getattr(usage, name, None) is not None
    }


def _rewritten(value: bytes, verdict: Verdict) -> bytes:
    """The record as the draft would have it: output tokens at most the cap, admitted at
    the end of its delay, for the downgraded model or routed pool."""
    if (
        verdict.max_output_tokens is None
        and verdict.admitted_ms is None
        and verdict.replaced is None
    ):
        return value
    raw = orjson.loads(value)
    usage = raw.get("usage") or {}
    cap = verdict.max_output_tokens
    if cap is not None and usage.get("output_tokens", 0) > cap:
        usage["output_tokens"] = cap
        raw["usage"] = usage
    if verdict.admitted_ms is not None:
        raw["occurred_at"] = _iso_ms(verdict.admitted_ms)
    if verdict.replaced is not None:
        name, replaced_by = verdict.replaced
        raw["subject"] = {**raw.get("subject", {}), name: replaced_by}
    return orjson.dumps(raw)


async def _read_topic(
    settings: WorkerSettings, name: str, since_ms: int | None, topic: int, out: list[_Merged]
) -> None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False, max_poll_records=5000
    )
    await consumer.start()
    try:
        tps = await partitions(consumer, settings.topic(name))
        if not tps:
            return
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        start = {tp: 0 for tp in tps}
        if since_ms is not None:
            found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
            start = {tp: (found[tp].offset if found[tp] else end[tp]) for tp in tps}
        for tp in tps:
            consumer.seek(tp, start[tp])
        remaining = {tp for tp in tps if start[tp] < end[tp]}
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=1000)
            for tp, messages in batch.items():
                for m in messages:
                    if m.offset < end[tp]:
                        value = m.value or b""
                        at = _event_ms(topic, value, m.timestamp)
                        out.append(_Merged(at, len(out), topic, m.timestamp, value))
                if messages and messages[-1].offset + 1 >= end[tp]:
                    remaining.discard(tp)
    finally:
        await stop(consumer)


async def simulate(
    settings: WorkerSettings,
    draft: Sequence[Policy],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    progress: Progress | None = None,
) -> Report:
    """Replay ``usage`` and ``refusals`` against ``draft``; nothing is written anywhere.

    Args:
        settings: where the topics are (and the prices file, the dedupe horizon).
        draft: the draft policies (see :func:`unsupported`).
        since: read from this time (broker time; default: the beginning).
        until: leave out records whose event time is later.
        progress: called with (records folded, records to fold).
    """
    from schemas.prices import load_catalog

    started = asyncio.get_running_loop().time()
    since_ms = None if since is None else int(since.timestamp() * 1000)
    records: list[_Merged] = []
    await _read_topic(settings, "usage", since_ms, 0, records)
    await _read_topic(settings, "refusals", since_ms, 1, records)
    until_ms = None if until is None else int(until.timestamp() * 1000)
    if until_ms is not None:
        records = [r for r in records if r.at_ms <= until_ms]
    records.sort(key=lambda r: (r.at_ms, r.order))
    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    longest = max((p.window_ms for p in draft), default=0)
    sim = Simulation(draft, prices, settings.horizon_ms(longest))
    try:
        for n, item in enumerate(records, 1):
            sim.feed(item)
            if progress is not None and (n % 2000 == 0 or n == len(records)):
                progress(n, len(records))
    finally:
        sim.close()
    sim.report.seconds = asyncio.get_running_loop().time() - started
    sim.report.keys_folded = len(sim.states)
    return sim.report


def run_simulation(
    settings: WorkerSettings,
    draft: Sequence[Policy],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    progress: Progress | None = None,
) -> Report:
    """Synchronous wrapper of :func:`simulate` for the CLI."""
    return asyncio.run(simulate(settings, draft, since=since, until=until, progress=progress))


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
