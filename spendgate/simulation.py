"""The pure part of ``spendgate simulate``: judge each request under the draft, fold the rest.

Records in (already merged by time), a report out; no Kafka, no Redis, no clock. See
:mod:`spendgate.simulate` for the counterfactual it computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from spendgate.admission.decide import Charge, Plan, Planner
from spendgate.admission.twin import KeyReading, key_input, plan_inputs
from spendgate.schemas.burst import BurstState
from spendgate.schemas.decision import DecisionResult, PlanInput, decide
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.exceptions import SpendgateError
from spendgate.schemas.fastdecode import FastSubject, decode
from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.policies import Policy
from spendgate.schemas.prices import PriceCatalog
from spendgate.schemas.refusals import RefusalGap
from spendgate.schemas.windows import WindowSpec, total
from spendgate.simulate_report import KeyReport, PolicyReport, Report, iso_ms, track
from spendgate.streams.dedupe import IdStore
from spendgate.streams.fold import Rules, UsageRecord, fold_usage
from spendgate.streams.ledger import KeyState

#: Records folded together at most (as replay's batches).
FOLD_BATCH = 2000

__all__ = ["ABSORB_LAG", "Merged", "Simulation", "Verdict", "caveats", "event_ms", "judge"]


#: The one assumption that holds for every draft: commits act at their instant.
ABSORB_LAG = (
    "commits take effect at their instant: live admission decides on a reservation's "
    "estimate until the worker has absorbed its commit, so where actuals differ from the "
    "estimates a request decided within that lag can go the other way (measured on three "
    "live runs of 400 admits on one 30 s policy: 0, 2 and 3 decided differently, refused "
    "304/304, 321/321 and 306 live/307 simulated; with actuals equal to the estimates the "
    "refused sets were the same)"
)


def caveats(policies: Sequence[Policy]) -> list[str]:
    """What the simulation leaves out for these drafts: the policies it cannot simulate
    in full, then :data:`ABSORB_LAG` (with no drafts: nothing)."""
    out = [
        f"{p.id}: overage cap_next is not simulated (the next reservations are judged at "
        "their estimates, not held at the observed ratio)"
        for p in policies
        if p.overage == "cap_next"
    ]
    return [*out, ABSORB_LAG] if policies else out


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


def _verdict(plan: Plan, result: DecisionResult) -> Verdict:
    """A twin's decision on ``plan`` (the reported one) as a verdict."""
    if not result.admitted:
        refusing = {
            c.target.policy.id
            for c, k in zip(plan.charges, result.keys, strict=True)
            if k.violated and c.target.policy.mode == "enforce"
        }
        return Verdict(True, tuple(sorted(refusing)))
    return Verdict(False, (), result.max_output_tokens, tuple(k.own for k in result.keys))


def judge(
    charges: Sequence[Charge],
    totals: Sequence[int],
    estimate_output: int,
    tokens: Sequence[int | None] | None = None,
) -> Verdict:
    """Judge one request as the admit script does (``schemas.decision``), all matching
    policies at once, from each key's window total alone (no alternatives, no Retry-After).

    Args:
        charges: the request's keys and amounts (``admission.decide.Planner.charges``).
        totals: each key's window total at the request's instant.
        estimate_output: the estimate's output tokens (what a cap lowers).
        tokens: per key with a ``burst``, the whole tokens in its bucket now; else None.
    """
    keys = []
    for i, c in enumerate(charges):
        left = tokens[i] if tokens is not None else None
        spec = c.target.policy.burst.spec() if c.target.policy.burst is not None else None
        bucket = BurstState(left * spec.per_ms, 0) if left is not None and spec else None
        # The total as one bucket at instant 0, where it counts in full.
        reading = KeyReading(absorbed={0: totals[i]} if totals[i] else {}, bucket=bucket)
        keys.append(key_input(c, reading, alternatives=False))
    plan = Plan(Subject(tenant="-"), tuple(charges))
    return _verdict(plan, decide([PlanInput(tuple(keys))], 0, estimate_output))


class Merged:
    """One record of either topic, in the merged order."""

    __slots__ = ("at_ms", "broker_ms", "order", "topic", "value")

    def __init__(self, at_ms: int, order: int, topic: int, broker_ms: int, value: bytes) -> None:
        self.at_ms = at_ms
        self.order = order
        self.topic = topic
        self.broker_ms = broker_ms
        self.value = value


def event_ms(topic: int, value: bytes, broker_ms: int) -> int:
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
        key_ids: the secret fields' key ids, as the worker's and admission's: the history's
            subjects are judged and folded in key-id form (``draft`` must be in it too).
    """

    def __init__(
        self,
        draft: Sequence[Policy],
        prices: PriceCatalog | None,
        dedupe_horizon_ms: int,
        key_ids: KeyIds | None = None,
    ) -> None:
        self.key_ids = key_ids
        self.planner = Planner(list(draft), prices)
        # The fold keeps the windows; its alerts are not wanted here.
        quiet = [p.model_copy(update={"alerts": [], "forecast": None}) for p in draft]
        self.rules = Rules(quiet, prices, local=lambda policy: True, key_ids=key_ids)
        self.specs = {p.id: WindowSpec(p.window_ms, p.bucket_ms, p.boundary) for p in draft}
        self.states: dict[str, KeyState] = {}
        self.ids = IdStore(None, dedupe_horizon_ms)
        self.report = Report({p.id: PolicyReport(policy=p) for p in draft})
        self.refused_reservations: set[str] = set()
        #: Request ids of refusal records the draft refuses too.
        self.refused_requests: set[str] = set()
        #: reservation id -> the output cap the draft put on it.
        self.capped: dict[str, int] = {}
        #: reservation id -> the subject field (and value) a downgrade or route replaced.
        self.replaced: dict[str, tuple[str, str]] = {}
        self.seen_refusals: set[str] = set()
        self._offset = 0
        self._broker_ms = 0
        #: Records waiting to be folded in one batch, and the keys they touch (``None``
        #: among them: not known, so the next judgment folds them first).
        self._pending: list[UsageRecord] = []
        self._pending_keys: set[str | None] = set()
        #: Admitted reservation -> the keys its request touches (where its settlements go).
        self._keys_of: dict[str, tuple[str | None, ...]] = {}
        #: The keys of every plan of the request judged last.
        self._judged_keys: tuple[str | None, ...] = (None,)
        #: Token buckets of the draft's ``burst`` policies, per budget key.
        self.bursts: dict[str, BurstState] = {}

    def close(self) -> None:
        """Release the dedupe set's temporary folder."""
        self.ids.close()

    def finish(self) -> None:
        """Fold what is still waiting (call once the last record was fed)."""
        self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        result = fold_usage(
            self._pending,
            self._load,
            self.rules,
            max_future_skew_ms=300_000,
            max_value_bytes=1 << 30,
            ids=self.ids,
        )
        for write in result.writes:
            self.states[write.key] = write.state
        self._pending = []
        self._pending_keys = set()

    def _state(self, key: str) -> KeyState | None:
        """A key's state with every record fed so far folded in: waiting records are
        folded first when one of them touches ``key`` (or might)."""
        pending = self._pending_keys
        if key in pending or None in pending:
            self._flush()
        return self.states.get(key)

    def _keys(self, subject: Subject | FastSubject) -> tuple[str | None, ...]:
        """The draft keys a record for ``subject`` touches (``(None,)``: not known)."""
        try:
            if self.key_ids is not None:
                subject = self.key_ids.subject(subject)
            return tuple(t.key for t in self.rules.index.targets(subject))
        except Exception:  # noqa: BLE001 - the fold refuses it; fold it before judging
            return (None,)

    def _load(self, key: str) -> KeyState:
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = KeyState()
        return state

    def _fold(self, value: bytes, broker_ms: int, keys: Sequence[str | None]) -> None:
        """Queue one record for the fold; it is folded before any judgment that reads a
        key it touches (``keys``), so every request is judged on the windows as they
        stand just before it, and records in between are folded in batches."""
        # Positions are the merged order's (one partition): the ledger applies each once.
        self._broker_ms = max(self._broker_ms, broker_ms)
        self._pending.append(UsageRecord(0, self._offset, self._broker_ms, value))
        self._pending_keys.update(keys)
        self._offset += 1
        if len(self._pending) >= FOLD_BATCH:
            self._flush()

    def feed(self, item: Merged) -> None:
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
            self._fold(item.value, item.broker_ms, ())
            return
        rid = event.reservation_id
        if event.kind == "reserve" and rid is not None:
            usage = Usage.model_validate(_usage_dict(event.usage))
            subject = _subject(event.subject)
            if self.key_ids is not None:
                subject = self.key_ids.subject(subject)
            verdict = self._judge(subject, usage, event.occurred_ms)
            if verdict is None or not verdict.refused:
                value = item.value
                if verdict is not None:
                    if verdict.max_output_tokens is not None:
                        self.capped[rid] = verdict.max_output_tokens
                    if verdict.replaced is not None:
                        self.replaced[rid] = verdict.replaced
                    value = _rewritten(value, verdict)
                self._keys_of[rid] = self._judged_keys
                self._fold(value, item.broker_ms, self._judged_keys)
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
        held = self._keys_of.get(rid) if rid is not None else None
        self._fold(value, item.broker_ms, held if held is not None else self._keys(event.subject))

    def _refusal(self, item: Merged) -> None:
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
            if self.key_ids is not None:
                # Refusals published before key ids were on carry raw values.
                subject = self.key_ids.subject(subject)
        except Exception:  # noqa: BLE001 - not a refusal record: nothing to judge
            return
        if request_id in self.seen_refusals:
            self.report.repeated_refusals += 1
            return
        self.seen_refusals.add(request_id)
        verdict = self._judge(subject, usage, item.at_ms)
        if verdict is not None and verdict.refused:
            self.refused_requests.add(request_id)
            return
        # Admitted by the draft: its estimate is held from its instant and never settled.
        body = {
            "event_id": f"simulated-{request_id}",
            "kind": "reserve",
            "subject": subject.model_dump(exclude_none=True),
            "occurred_at": iso_ms(item.at_ms),
            "reservation_id": f"simulated-{request_id}",
            "usage": usage.model_dump(exclude_none=True),
            "expires_at": iso_ms(item.at_ms + 1),
        }
        value = orjson.dumps(body)
        if verdict is not None:
            value = _rewritten(value, verdict)
        self._fold(value, item.broker_ms, self._judged_keys if verdict is not None else (None,))

    def _judge(self, subject: Subject, usage: Usage, at_ms: int) -> Verdict | None:
        """Judge a request at ``at_ms``; None when no draft policy matches it (or it
        cannot be judged); the report is updated."""
        report = self.report
        report.requests += 1
        self._judged_keys = (None,)
        try:
            plans = self.planner.plans(subject, usage)
        except SpendgateError:
            report.unjudged += 1
            return None
        charges = plans[0].charges
        self._judged_keys = tuple(c.target.key for plan in plans for c in plan.charges)
        if not charges:
            report.unmatched += 1
            return None
        result = self._decide(plans, usage, at_ms)
        first = verdict = self._verdict_of(plans, result)
        if result.plan > 0:
            # Admitted by an alternative: which keys of the plan asked refused it.
            asked = self._decide(plans[:1], usage, at_ms, read_only=True)
            first = _verdict(plans[0], dataclasses.replace(asked, outcome="reject"))
        if verdict.refused:
            delayed = self._delayed(plans, result, usage, at_ms)
            if delayed is not None:
                result, verdict = delayed
        if not verdict.refused:
            self._take(plans[result.plan], result)
        self._count(charges, self._totals(charges, at_ms), first, verdict, at_ms)
        return verdict

    def _count(
        self,
        charges: Sequence[Charge],
        totals: Sequence[int],
        first: Verdict,
        v: Verdict,
        at_ms: int,
    ) -> None:
        """The report's figures of one judged request (on the keys of the plan asked)."""
        report = self.report
        at = datetime.fromtimestamp(at_ms / 1000, UTC)
        if first.refused and not v.refused:
            for pid in first.violated:
                pr = report.policies[pid]
                if v.admitted_ms is not None:
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
            refused_here = v.refused and policy.id in v.violated
            held_here = not v.refused and v.replaced is None
            used_after = totals[i] + (v.amounts[i] if held_here else 0)
            track(kr, at_ms, used_after, refused_here)
            if refused_here:
                pr.refuse(at, c.amount)
                kr.refuse(at, c.amount)
            elif held_here and v.max_output_tokens is not None and v.amounts[i] < c.amount:
                pr.capped += 1
                kr.capped += 1

    def _reading(self, charge: Charge) -> KeyReading:
        """A key as the draft holds it: every record fed so far folded in (reservations
        included: nothing is pending), vouched for, its token bucket."""
        state = self._state(charge.target.key)
        return KeyReading(
            absorbed=state.buckets if state is not None else {},
            bucket=self.bursts.get(charge.target.key),
        )

    def _decide(
        self, plans: Sequence[Plan], usage: Usage, at_ms: int, *, read_only: bool = False
    ) -> DecisionResult:
        """The admit script's decision at ``at_ms``, by its twin."""
        return decide(
            plan_inputs(plans, self._reading), at_ms, usage.output_tokens, read_only=read_only
        )

    @staticmethod
    def _verdict_of(plans: Sequence[Plan], result: DecisionResult) -> Verdict:
        verdict = _verdict(plans[result.plan], result)
        if result.plan == 0 or verdict.refused:
            return verdict
        plan = plans[result.plan]
        name = "model" if plan.kind == "downgrade" else "pool"
        replaced = (name, plan.subject.value(name) or "")
        return dataclasses.replace(verdict, replaced=replaced)

    def _take(self, plan: Plan, result: DecisionResult) -> None:
        """An admitted request takes its amounts from the buckets of the plan admitted."""
        for c, key in zip(plan.charges, result.keys, strict=True):
            if key.bucket_after is not None:
                self.bursts[c.target.key] = key.bucket_after

    def _totals(self, charges: Sequence[Charge], at_ms: int) -> list[int]:
        out = []
        for c in charges:
            state = self._state(c.target.key)
            spec = self.specs[c.target.policy.id]
            out.append(total(spec, state.buckets, at_ms) if state is not None else 0)
        return out

    def _delayed(
        self, plans: Sequence[Plan], refused: DecisionResult, usage: Usage, at_ms: int
    ) -> tuple[DecisionResult, Verdict] | None:
        """``delay``: refused only by delay policies, and the request fits (the twin's
        Retry-After, assuming no new usage, as admission's exact one) within the smallest
        ``max_delay`` among them: decided again at that instant, as ``admission.delay``
        holds it and asks the script again."""
        plan = plans[0]
        if refused.plan != 0 or refused.retry_after_ms is None or refused.never_fits:
            return None
        allowed: int | None = None
        for c, key in zip(plan.charges, refused.keys, strict=True):
            p = c.target.policy
            if not key.violated or p.mode != "enforce":
                continue
            if p.on_exceed != "delay":
                return None
            allowed = p.max_delay_ms if allowed is None else min(allowed, p.max_delay_ms)
        if allowed is None or refused.retry_after_ms > allowed:
            return None
        then = at_ms + refused.retry_after_ms
        again = self._decide(plans, usage, then)
        verdict = self._verdict_of(plans, again)
        if verdict.refused:
            return None
        return again, dataclasses.replace(verdict, admitted_ms=then)


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
        raw["occurred_at"] = iso_ms(verdict.admitted_ms)
    if verdict.replaced is not None:
        name, replaced_by = verdict.replaced
        raw["subject"] = {**raw.get("subject", {}), name: replaced_by}
    return orjson.dumps(raw)
