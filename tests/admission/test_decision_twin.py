"""ADMIT (``admission/scripts/admit.lua``) against its pure Python twin (``schemas.decision``)
on random cases, on the real Redis (this test's key prefix, deleted after) and embedded.

Each case seeds a request's keys in Redis (absorbed windows of either version, in the
policy's bucket width or another, refunds among them; both pending windows; the marks;
token buckets), runs the real script, then asks the twin with the same state as values at
the instant the script reported (the Redis clock), and asserts the same reply: outcome,
plan, Retry-After (and never-fits), max output tokens and every key's used, reserved, own,
violated, reset, state and burst figures. The cases cover several plans (alternatives,
shared keys), cap, observe, burst, every boundary, stale and missing marks under each
failure mode, pending reservations, never-fits and read-only evaluations; a coverage check
at the end fails the test when the generator stopped reaching one of them.

Marks are drawn by age: at the staleness bound and 1 ms either side of it (a mark exactly
``staleness`` old is still vouched for, 1 ms older is stale), far on both sides, ahead of
the clock, and missing. The script's clock (Redis TIME) is not the test's, so a mark's
value is its age taken from the instant the script is expected to run (the test's clock
plus the lag measured on the previous cases). The twin classifies the marks itself, with
``schemas.decision.marks_states`` and ``key_state``, at the instant the script reported;
the coverage check requires that the three ages at the bound were really reached (by the
script's clock) in a mark that decides the state of a key the script reported.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from redis.client import Pipeline

from spendgate.admission.scripts.admit import (
    SCRIPT,
    AdmitCall,
    AdmitHeader,
    AdmitResult,
    AdmitTarget,
)
from spendgate.admission.scripts.codes import FAILURE_MODES
from spendgate.schemas.burst import BurstSpec, BurstState, encode_state
from spendgate.schemas.decision import KeyInput, PlanInput, decide, key_state, marks_states
from spendgate.schemas.window_codec import encode, read
from spendgate.schemas.windows import BOUNDARIES, WindowSpec, rebucket
from tests.fixtures.embedded_lua import LuaServer
from tests.fixtures.seeds import derive

SEED = derive("test_decision_twin")
CASES = 300
STALENESS_MS = 60_000
#: Mark ages at the staleness bound: 1 ms younger (vouched), exactly at it (vouched: only a
#: mark *older* than the bound is stale), 1 ms older (stale).
AT_BOUND = (STALENESS_MS - 1, STALENESS_MS, STALENESS_MS + 1)
#: Mark ages far from it: ahead of the script's clock, fresh, 1 s old, 10 bounds old; and
#: missing (None).
MARK_AGES: tuple[int | None, ...] = (
    *AT_BOUND,
    *AT_BOUND,
    -5_000,
    0,
    1_000,
    10 * STALENESS_MS,
    None,
    None,
)
_ON_EXCEED_CODE = {"reject": 0, "cap": 1, "alternative": 2}


@dataclass
class Target:
    """One key of a plan: what the script is told and what Redis holds."""

    key: KeyInput
    name: str
    #: The absorbed window's format version (None: no key) and the width it is stored in.
    version: int | None
    stored_ms: int
    pending_v1: dict[int, int] = field(default_factory=dict)
    pending_v2: dict[int, int] = field(default_factory=dict)
    deps: tuple[int, ...] = ()
    #: The absorbed buckets, in the policy's width.
    absorbed: dict[int, int] = field(default_factory=dict)


@dataclass
class Case:
    plans: list[list[Target]]
    #: Each mark's age at the script's expected instant (None: missing).
    ages: list[int | None]
    est_out: int
    read_only: bool
    #: The marks' values, fixed just before the case is seeded (:func:`_place_marks`).
    marks: list[int | None] = field(default_factory=list)


def _buckets(rng: random.Random, spec: WindowSpec, now: int, limit: int) -> dict[int, int]:
    b = spec.bucket_ms
    head = now - now % b
    out: dict[int, int] = {}
    for _ in range(rng.randint(0, 6)):
        start = head - rng.randint(-1, spec.window_ms // b + 2) * b
        amount = rng.randint(1, max(1, limit // 3))
        if rng.random() < 0.1:
            amount = -amount  # a refund
        out[start] = out.get(start, 0) + amount
    return {s: a for s, a in out.items() if a and s >= 0}


def _cap_terms(rng: random.Random, est_out: int) -> tuple[int, int, int, int]:
    """(s, r, d, amount) of a unit: output tokens, total tokens, cost, or requests."""
    kind = rng.randrange(4)
    if kind == 0:
        return 0, 1, 1, est_out
    if kind == 1:
        s = rng.randint(0, 300)
        return s, 1, 1, s + est_out
    if kind == 2:
        s, r, d = rng.randint(0, 10**7), rng.randint(1, 30_000), 1_000_000
        return s, r, d, -(-(s + est_out * r) // d)
    return 0, 0, 1, rng.choice([1, 1, 2, 500])


def _key(
    rng: random.Random, now: int, est_out: int, alternatives: int, nmarks: int
) -> tuple[
    KeyInput, int | None, int, dict[int, int], dict[int, int], dict[int, int], tuple[int, ...]
]:
    b = rng.choice([1000, 2000, 5000])
    spec = WindowSpec(b * rng.randint(1, 6), b, rng.choice(BOUNDARIES))
    s, r, d, amount = _cap_terms(rng, est_out)
    limit = rng.choice(
        [max(1, amount), amount + rng.randint(0, 60), rng.randint(1, 3 * amount + 5)]
    )
    if rng.random() < 0.08:
        limit = max(0, amount - 1)  # never fits
    observe = rng.random() < 0.15
    on_exceed = rng.choice(
        ["reject", "cap", "cap", "alternative"] if alternatives else ["reject", "cap"]
    )
    alternative = rng.randint(1, alternatives) if on_exceed == "alternative" else 0
    burst = None
    bucket = None
    if rng.random() < 0.3:
        burst = BurstSpec(
            rng.randint(1, 5), rng.choice([1000, 10_000]), rng.randint(1, max(1, 2 * amount))
        )
        if rng.random() < 0.7:
            bucket = BurstState(rng.randint(0, burst.full), now - rng.randint(0, 20_000))
    version = rng.choice([None, 1, 2, 2, 2, 2])
    stored_ms = b if rng.random() < 0.85 else rng.choice([1000, 2000, 5000])
    absorbed = _buckets(rng, spec, now, limit) if version is not None else {}
    p1 = _buckets(rng, spec, now, limit) if rng.random() < 0.2 else {}
    p2 = _buckets(rng, spec, now, limit) if rng.random() < 0.6 else {}
    p1 = {k: abs(v) for k, v in p1.items()}
    p2 = {k: abs(v) for k, v in p2.items()}
    deps = tuple(sorted(rng.sample(range(nmarks), rng.randint(0, min(2, nmarks)))))
    key = KeyInput(
        spec=spec,
        limit=limit,
        amount=amount,
        observe=observe,
        on_exceed=on_exceed,  # type: ignore[arg-type]
        alternative=alternative,
        cap_s=s,
        cap_r=r,
        cap_d=d,
        failure=rng.choice(["closed", "open", "degraded"]),
        burst=burst,
        bucket=bucket,
    )
    return key, version, stored_ms, absorbed, p1, p2, deps


def random_case(rng: random.Random, index: int, now: int) -> Case:
    """One request's plans and state, around ``now``."""
    nmarks = rng.randint(0, 3)
    ages = [rng.choice(MARK_AGES) for _ in range(nmarks)]
    est_out = rng.randint(1, 400)
    nplans = rng.choice([1, 1, 2, 3])
    plans: list[list[Target]] = []
    for p in range(nplans):
        targets = []
        for j in range(rng.randint(1, 3)):
            if p > 0 and plans[0] and rng.random() < 0.3:
                # A key both plans hold (a tenant-wide policy matching either model).
                shared = rng.choice(plans[0])
                key = KeyInput(**{**_fields(shared.key), "on_exceed": "reject", "alternative": 0})
                targets.append(
                    Target(
                        key,
                        shared.name,
                        shared.version,
                        shared.stored_ms,
                        shared.pending_v1,
                        shared.pending_v2,
                        shared.deps,
                        shared.absorbed,
                    )
                )
                continue
            key, version, stored_ms, absorbed, p1, p2, deps = _key(
                rng, now, est_out, nplans - 1 if p == 0 else 0, nmarks
            )
            name = f"{index}:{p}:{j}"
            targets.append(Target(key, name, version, stored_ms, p1, p2, deps, absorbed))
        plans.append(targets)
    return Case(plans, ages, est_out, rng.random() < 0.1)


def _place_marks(case: Case, expected_now: int) -> None:
    """The marks' values: each mark its age before the instant the script should run."""
    case.marks = [None if age is None else expected_now - age for age in case.ages]


def _fields(key: KeyInput) -> dict[str, object]:
    return {name: getattr(key, name) for name in KeyInput.__dataclass_fields__}


def _raw_window(target: Target) -> bytes | None:
    """The absorbed window as the worker would store it (maybe in an older width)."""
    if target.version is None:
        return None
    b = target.key.spec.bucket_ms
    absorbed = target.absorbed
    buckets = absorbed if target.stored_ms == b else rebucket(absorbed, b, target.stored_ms)
    return encode(buckets, target.stored_ms, target.version)


def _seed(p: Pipeline, prefix: str, case: Case) -> None:
    marks_key = f"{prefix}marks"
    for i, mark in enumerate(case.marks):
        if mark is not None:
            p.hset(marks_key, f"m{i}", mark)
    seen: set[str] = set()
    for targets in case.plans:
        for t in targets:
            if t.name in seen:
                continue
            seen.add(t.name)
            base = f"{prefix}{t.name}:"
            raw = _raw_window(t)
            if raw is not None:
                p.set(base + "w", raw)
            b = t.key.spec.bucket_ms
            if t.pending_v1:
                p.hset(base + "pw", mapping={s + b - 1: a for s, a in t.pending_v1.items()})
            if t.pending_v2:
                fields = sorted(s + b - 1 for s in t.pending_v2)
                mapping: dict[str, int] = {str(s + b - 1): a for s, a in t.pending_v2.items()}
                mapping["t"] = sum(t.pending_v2.values())
                mapping["h"], mapping["n"] = fields[0], fields[-1]
                p.hset(base + "pv", mapping=mapping)
                p.rpush(base + "pq", *fields)
            if t.key.bucket is not None:
                p.set(base + "bt", encode_state(t.key.bucket))


def _call(prefix: str, index: int, case: Case) -> tuple[list[str], list[int | str]]:
    call = AdmitCall(
        f"{prefix}{index}:answer", f"{prefix}{index}:record", f"{prefix}unpub", f"{prefix}marks"
    )
    for targets in case.plans:
        call.plan('{"tenant":"t"}', len(targets))
        for t in targets:
            k = t.key
            base = f"{prefix}{t.name}:"
            argv = AdmitTarget(
                limit=k.limit,
                window_ms=k.spec.window_ms,
                bucket_ms=k.spec.bucket_ms,
                boundary=k.spec.boundary,
                amount=k.amount,
                reservation_ttl_ms=60_000,
                observe=k.observe,
                on_exceed=_ON_EXCEED_CODE[k.on_exceed],
                downgrade_plan=k.alternative + 1 if k.alternative else 0,
                cap_s=k.cap_s,
                cap_r=k.cap_r,
                cap_d=k.cap_d,
                deps=tuple(d + 1 for d in t.deps),
                failure=FAILURE_MODES[k.failure],
                burst=k.burst.encode() if k.burst is not None else "",
            ).argv()
            held = [base + kind for kind in ("w", "pw", "pv", "pq", "pr", "pe")]
            call.target(held, base + "bt" if k.burst is not None else None, argv)
    header = AdmitHeader(
        read_only=case.read_only,
        reservation_id=f"r{index}",
        idempotency_ttl_ms=60_000,
        record_ttl_ms=60_000,
        estimate_output_tokens=case.est_out,
        estimate_json="{}",
        plans=len(case.plans),
        staleness_ms=STALENESS_MS,
        marks=tuple(f"m{i}" for i in range(len(case.marks))),
    )
    return call.finish(header)


def _twin_plans(case: Case, now: int) -> list[PlanInput]:
    """The twin's inputs: the state the script reads, as values at the script's instant."""
    states = marks_states(case.marks, now, STALENESS_MS)
    plans = []
    for targets in case.plans:
        keys = []
        for t in targets:
            b = t.key.spec.bucket_ms
            window = read(_raw_window(t), b)
            pending: dict[int, int] = {}
            for part in (t.pending_v1, t.pending_v2):
                for s, a in part.items():
                    pending[s] = pending.get(s, 0) + a
            state = key_state(t.deps, states)
            keys.append(
                KeyInput(
                    **{**_fields(t.key), "absorbed": window, "pending": pending, "state": state}
                )
            )
        plans.append(PlanInput(tuple(keys)))
    return plans


def _covered(case: Case, result: AdmitResult) -> set[str]:
    keys = [t.key for targets in case.plans for t in targets]
    seen = {result.outcome} | {f"boundary:{k.spec.boundary}" for k in keys}
    seen |= {f"failure:{k.failure}" for k in keys}
    seen |= {"burst" for k in keys if k.burst is not None}
    seen |= {"pending" for targets in case.plans for t in targets if t.pending_v1 or t.pending_v2}
    seen |= {f"state:{s.state}" for s in result.keys}
    if result.never_fits:
        seen.add("never_fits")
    if result.plan > 0:
        seen.add("alternative_chosen")
    if len(case.plans) > 1:
        seen.add("plans")
    if case.read_only:
        seen.add("read_only")
    seen |= _bound_probes(case, result.now_ms, case.plans[result.plan])
    return seen


def _bound_probes(case: Case, now: int, reported: list[Target]) -> set[str]:
    """The ages at the staleness bound that the script really met (its clock, ``now``) in
    a mark that decides the state of a key it reported: every other mark that key depends
    on is vouched for, so the mark's own state is the key's."""
    states = marks_states(case.marks, now, STALENESS_MS)
    seen = set()
    for t in reported:
        for d in t.deps:
            mark = case.marks[d]
            if mark is None or any(states[o] != "vouched" for o in t.deps if o != d):
                continue
            off = now - mark - STALENESS_MS
            if -1 <= off <= 1:
                seen.add(f"mark_age:bound{off:+d}ms" if off else "mark_age:bound")
    return seen


class TestDecisionTwin:
    def test_admit_script_and_twin_give_the_same_reply(self, lua_server: LuaServer) -> None:
        rng = random.Random(SEED)
        script = lua_server.script(SCRIPT.source)
        client = lua_server.client
        coverage: Counter[str] = Counter()
        # ms from the test's clock before seeding to the script's reported instant.
        lags: deque[int] = deque([1], maxlen=15)
        for index in range(CASES):
            prefix = f"{lua_server.prefix}dt{index}:"
            now = int(time.time() * 1000)
            case = random_case(rng, index, now)
            before = int(time.time() * 1000)
            _place_marks(case, before + int(statistics.median_low(lags)))
            pipe = client.pipeline(transaction=False)
            _seed(pipe, prefix, case)
            pipe.execute()
            keys, args = _call(prefix, index, case)
            result = AdmitResult.decode(script(keys=keys, args=args))
            lags.append(result.now_ms - before)
            twin = decide(
                _twin_plans(case, result.now_ms),
                result.now_ms,
                case.est_out,
                read_only=case.read_only,
            )
            got = (
                twin.outcome,
                twin.plan,
                twin.retry_after_ms,
                twin.never_fits,
                twin.max_output_tokens,
                [
                    (k.used, k.reserved, k.own, k.violated, k.reset_after_ms, k.state, k.burst)
                    for k in twin.keys
                ],
            )
            want = (
                result.outcome,
                result.plan,
                result.retry_after_ms,
                result.never_fits,
                result.max_output_tokens,
                [
                    (k.used, k.reserved, k.own, k.violated, k.reset_after_ms, k.state, k.burst)
                    for k in result.keys
                ],
            )
            assert got == want, (SEED, index, result.now_ms, case)
            coverage.update(_covered(case, result))
        needed = {
            "reject",
            "allow",
            "cap",
            "observe_reject",
            "unvouched",
            "never_fits",
            "alternative_chosen",
            "plans",
            "burst",
            "pending",
            "read_only",
            "state:stale",
            "state:missing",
            "mark_age:bound-1ms",
            "mark_age:bound",
            "mark_age:bound+1ms",
            "failure:open",
            "failure:closed",
            "failure:degraded",
            *(f"boundary:{b}" for b in BOUNDARIES),
        }
        missing = needed - set(coverage)
        assert not missing, (missing, coverage)
        print(dict(sorted(coverage.items())))
