"""The admission decision's pure Python twin: what ``admission/scripts/admit.lua`` decides.

ADMIT decides in Lua, atomically, on Redis's state; this module decides the same thing from
that state handed in as values, with no Redis, Kafka or clock (time is ``now_ms``). A test
(``tests/admission/test_decision_twin.py``) runs both on random cases, on a real Redis and
embedded, and asserts the same reply; ``spendgate simulate`` decides with this module, so
what it predicts is what admission does.

The model, as the script's header states it:

* A request is one or more plans (:class:`PlanInput`): plan 0 the subject as sent, the
  others alternatives (a downgrade's model or a route's pool replaced). Alternatives are
  tried only when every refusal of plan 0 comes from keys offering one, in the order those
  keys come in plan 0; the first that decides anything but a refusal wins; an alternative
  never falls back on another.
* Per key (:class:`KeyInput`): usage is the absorbed window plus the pending window added
  bucket by bucket (:func:`schemas.windows.combine`); ``used`` is the absorbed total (never
  below 0), ``reserved`` what the pending window adds. The window refuses when
  ``used + reserved + amount > limit``, except a key whose marks are stale or missing and
  whose policy fails open. A ``burst`` bucket (:mod:`schemas.burst`) refuses beside it.
* A key whose marks are stale or missing, enforced and not failing open, makes the outcome
  ``unvouched`` (nothing reserved; the caller answers from the failure mode) before anything
  else is looked at (not in a read-only evaluation).
* Refused by an enforce key offering no way out: ``reject`` with the Retry-After at which
  every refusing enforce key fits (``NEVER_FITS`` when one never can). Only ``cap`` keys
  refused: the largest output every enforce key fits (:func:`cap_output`), or ``reject``.
  Only observe keys refused: ``observe_reject``, their Retry-After reported.
* Each key of the reported plan reports its ``reset_after_ms`` (until everything counted
  and the request's own amount aged out) and, with a burst, its whole tokens left and the
  ms until full (after the request's take when it holds something).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from spendgate.schemas.burst import BurstSpec, BurstState, check, full_after_ms, take
from spendgate.schemas.windows import Held, WindowSpec, combine, retry_after

__all__ = [
    "NEVER_FITS",
    "DecisionResult",
    "KeyInput",
    "KeyView",
    "KeyWindowState",
    "OnExceed",
    "Outcome",
    "PlanInput",
    "cap_output",
    "capped_amount",
    "decide",
    "key_state",
    "marks_states",
    "reset_after_ms",
]

#: What the decision answers (ADMIT's outcome codes decode to these).
Outcome = Literal["reject", "allow", "cap", "observe_reject", "unvouched"]
#: Whether the window is vouched for by the worker's marks (``schemas.shards``).
KeyWindowState = Literal["vouched", "stale", "missing"]
#: A key's ``on_exceed`` as the decision reads it: ``delay`` refuses like ``reject`` (the
#: waiting is the caller's), ``downgrade`` and ``route`` are both ``alternative``.
OnExceed = Literal["reject", "cap", "alternative"]
#: ``retry_after_ms`` when the request can never fit.
NEVER_FITS = -2

_STATE_RANK: dict[KeyWindowState, int] = {"vouched": 0, "stale": 1, "missing": 2}
#: Lua numbers are doubles: the script skips a cap whose arithmetic would leave them.
_EXACT = 2**53


@dataclass(frozen=True, slots=True)
class KeyInput:
    """One budget key of a plan: the script's per-target arguments and the key's state.

    Attributes:
        spec: the policy's window (``window_ms``, ``bucket_ms``, ``boundary``).
        limit: the policy's limit.
        amount: what the request would hold on this key.
        observe: ``mode: observe`` (never refuses; its state only shows).
        on_exceed: what a refusal of this key allows.
        alternative: with ``alternative``, the 0-based index of the plan to try (0: none).
        cap_s, cap_r, cap_d: the amount at ``o`` output tokens is
            ``ceil((cap_s + o * cap_r) / cap_d)``; ``cap_r == 0``: capping cannot lower it.
        failure: the policy's failure mode (what an unvouched window means).
        burst: the policy's token bucket, or None.
        absorbed: the absorbed window (bucket start -> amount), as the worker wrote it.
        pending: the pending reservations (bucket start -> amount), both versions merged.
        state: whether the worker's marks vouch for the window (:func:`key_state`).
        bucket: the token bucket's stored state (None: full); only with ``burst``.
    """

    spec: WindowSpec
    limit: int
    amount: int
    observe: bool = False
    on_exceed: OnExceed = "reject"
    alternative: int = 0
    cap_s: int = 0
    cap_r: int = 0
    cap_d: int = 1
    failure: Literal["closed", "open", "degraded"] = "closed"
    burst: BurstSpec | None = None
    absorbed: Mapping[int, int] = field(default_factory=dict)
    pending: Mapping[int, int] = field(default_factory=dict)
    state: KeyWindowState = "vouched"
    bucket: BurstState | None = None


@dataclass(frozen=True, slots=True)
class PlanInput:
    """One plan: its keys in the order the script gets them."""

    keys: tuple[KeyInput, ...]


@dataclass(frozen=True, slots=True)
class KeyView:
    """One key of the reported plan as the decision saw it (``AdmitResult.keys``).

    Attributes:
        used: the absorbed total (never below 0).
        reserved: what the pending reservations add to it.
        own: what this request holds on it (0 when nothing is reserved).
        violated: the window or the bucket refused the request's amount.
        reset_after_ms: until every amount counted now (and ``own``) has aged out.
        state: the window's state.
        burst: with a burst, whole tokens left and ms until the bucket is full.
        bucket_after: with a burst, the bucket's state after this request (what the script
            stores when the request holds something; the level as of ``now_ms`` else).
    """

    used: int
    reserved: int
    own: int
    violated: bool
    reset_after_ms: int
    state: KeyWindowState = "vouched"
    burst: tuple[int, int] | None = None
    bucket_after: BurstState | None = None


@dataclass(frozen=True, slots=True)
class DecisionResult:
    """The decision (``AdmitResult`` without the replay and the reservation id).

    Attributes:
        outcome: what was decided.
        plan: the reported plan (0-based): the one admitted, else plan 0.
        retry_after_ms: ms until every refusing key fits (``reject``; the observe keys'
            for ``observe_reject``), None when no wait applies or none is known.
        never_fits: a refusing key can never fit the request.
        max_output_tokens: with ``cap``, the output tokens granted.
        keys: each key of the reported plan.
    """

    outcome: Outcome
    plan: int
    retry_after_ms: int | None
    never_fits: bool
    max_output_tokens: int | None
    keys: tuple[KeyView, ...]

    @property
    def admitted(self) -> bool:
        """Whether the request holds its reservation (allow, cap, observe_reject)."""
        return self.outcome not in ("reject", "unvouched")


def marks_states(
    marks: Sequence[int | None], now_ms: int, staleness_ms: int
) -> list[KeyWindowState]:
    """Each mark's state: missing (None), stale (older than ``now_ms - staleness_ms``),
    else vouched."""
    oldest = now_ms - staleness_ms
    return [
        "missing" if mark is None else "stale" if mark < oldest else "vouched" for mark in marks
    ]


def key_state(deps: Sequence[int], states: Sequence[KeyWindowState]) -> KeyWindowState:
    """The worst state of the marks a key depends on (``deps``: 0-based indexes)."""
    return max((states[d] for d in deps), key=_STATE_RANK.__getitem__, default="vouched")


def capped_amount(key: KeyInput, output: int) -> int:
    """The key's amount at ``output`` tokens (its amount when capping cannot lower it)."""
    if key.cap_r == 0:
        return key.amount
    return -(-(key.cap_s + output * key.cap_r) // key.cap_d)


@dataclass(slots=True)
class _Loaded:
    """A key read at ``now``: the script's ``x`` after ``load``."""

    key: KeyInput
    held: Held
    used: int
    reserved: int
    window_violated: bool
    violated: bool
    level: int = 0
    bucket_fits: bool = True
    bucket_wait_ms: int = 0
    bucket_never: bool = False
    own: int = 0


def _load(key: KeyInput, now_ms: int) -> _Loaded:
    held = combine(key.spec, key.absorbed, key.pending, now_ms)
    used = held.used
    window_violated = used + held.pending + key.amount > key.limit
    if key.state != "vouched" and key.failure == "open":
        window_violated = False
    x = _Loaded(key, held, used, held.pending, window_violated, window_violated)
    if key.burst is not None:
        got = check(key.burst, key.bucket, now_ms, key.amount)
        x.level, x.bucket_fits = got.level, got.fits
        x.bucket_wait_ms, x.bucket_never = got.wait_ms, got.never_fits
        if not got.fits:
            x.violated = True
    return x


def cap_output(
    keys: Sequence[KeyInput], used: Sequence[tuple[int, int, int | None]], asked: int
) -> int | None:
    """The largest output (at most ``asked``) at which every enforce key fits, or None.

    Args:
        keys: the plan's keys.
        used: per key, ``(used, reserved, whole tokens in its bucket or None)``.
        asked: the estimate's output tokens.
    """
    best = asked
    for key, (u, reserved, tokens) in zip(keys, used, strict=True):
        if key.observe:
            continue
        room = key.limit - u - reserved
        if tokens is not None:
            room = min(room, tokens)
        if key.cap_r == 0:
            if key.amount > room:
                return None
        elif room * key.cap_d < _EXACT:
            v = room * key.cap_d - key.cap_s
            if v < 0:
                return None
            best = min(best, v // key.cap_r)
    return best if best >= 1 else None


def _wait_of(x: _Loaded, now_ms: int) -> int:
    """One refusing key's wait: its window's and its bucket's, whichever is later."""
    wait = 0
    key = x.key
    if x.window_violated:
        found = retry_after(key.spec, x.held.buckets, now_ms, limit=key.limit, amount=key.amount)
        if found.never_fits:
            wait = NEVER_FITS
        elif found.fits_at_ms is not None:
            wait = found.fits_at_ms - now_ms
        else:
            wait = key.spec.window_ms + key.spec.bucket_ms
    if key.burst is not None and not x.bucket_fits:
        if x.bucket_never:
            wait = NEVER_FITS
        elif wait != NEVER_FITS:
            wait = max(wait, x.bucket_wait_ms)
    return wait


def _retry_of(loaded: Sequence[_Loaded], observe: bool, now_ms: int) -> int:
    retry = -1
    for x in loaded:
        if x.violated and x.key.observe == observe:
            wait = _wait_of(x, now_ms)
            retry = NEVER_FITS if NEVER_FITS in (wait, retry) else max(retry, wait)
    return retry


#: ``evaluate``'s outcomes: the final ones, or ``alternatives`` (plan 0 only).
_Evaluated = tuple[Outcome | Literal["alternatives"], int | list[int] | None]


def _evaluate(
    loaded: Sequence[_Loaded], asked: int, may_alternate: bool, read_only: bool
) -> _Evaluated:
    if not read_only and any(
        x.key.state != "vouched" and not x.key.observe and x.key.failure != "open" for x in loaded
    ):
        return "unvouched", None
    hard = capped = observed = False
    alternatives: list[int] = []
    for x in loaded:
        if not x.violated:
            continue
        key = x.key
        if key.observe:
            observed = True
        elif key.on_exceed == "cap":
            capped = True
        elif key.on_exceed == "alternative" and may_alternate and key.alternative > 0:
            if key.alternative not in alternatives:
                alternatives.append(key.alternative)
        else:
            hard = True
    if hard:
        return "reject", None
    if alternatives:
        return "alternatives", alternatives
    if capped:
        figures = [
            (x.used, x.reserved, x.level // x.key.burst.per_ms if x.key.burst else None)
            for x in loaded
        ]
        output = cap_output([x.key for x in loaded], figures, asked)
        if output is None:
            return "reject", None
        for x in loaded:
            x.own = capped_amount(x.key, output)
        return "cap", output
    for x in loaded:
        x.own = x.key.amount
    return ("observe_reject" if observed else "allow"), None


def reset_after_ms(spec: WindowSpec, buckets: Mapping[int, int], now_ms: int, own: int) -> int:
    """Ms from ``now_ms`` until every amount counted then (and ``own > 0``, held in the
    bucket of ``now_ms``) has aged out of the window, with nothing new."""
    b, w = spec.bucket_ms, spec.window_ms
    head = now_ms - now_ms % b
    oldest = head - w + (b if spec.boundary == "exclude" else 0)
    last = max((s for s, a in buckets.items() if a and s >= oldest), default=None)
    if own > 0 and (last is None or head > last):
        last = head
    if last is None:
        return 0
    gone = last + w + (0 if spec.boundary == "exclude" else b - 1)
    return max(0, gone - now_ms)


def _view(x: _Loaded, now_ms: int, read_only: bool) -> KeyView:
    key = x.key
    burst = after = None
    if key.burst is not None:
        taken = x.own if x.own > 0 and not read_only else 0
        after = take(key.burst, x.level, now_ms, taken)
        burst = (after.level // key.burst.per_ms, full_after_ms(key.burst, after.level))
    return KeyView(
        used=x.used,
        reserved=x.reserved,
        own=x.own,
        violated=x.violated,
        reset_after_ms=reset_after_ms(key.spec, x.held.buckets, now_ms, x.own),
        state=key.state,
        burst=burst,
        bucket_after=after,
    )


def decide(
    plans: Sequence[PlanInput],
    now_ms: int,
    estimate_output_tokens: int,
    *,
    read_only: bool = False,
) -> DecisionResult:
    """Decide one request as ADMIT does (see the module docstring).

    Args:
        plans: plan 0, the request as sent, then its alternatives.
        now_ms: the decision instant (ADMIT: the Redis clock).
        estimate_output_tokens: the estimate's output tokens (what a cap lowers).
        read_only: evaluate plan 0 only (no alternatives, no unvouched outcome, nothing
            taken from the buckets), as ``GET /v1/budgets`` asks.

    Returns:
        The outcome, the reported plan and each of its keys.
    """
    loaded: dict[int, list[_Loaded]] = {}

    def load(p: int) -> list[_Loaded]:
        if p not in loaded:
            loaded[p] = [_load(k, now_ms) for k in plans[p].keys]
        return loaded[p]

    chosen = 0
    outcome, value = _evaluate(load(0), estimate_output_tokens, not read_only, read_only)
    if outcome == "alternatives":
        assert isinstance(value, list)
        alternatives = value
        outcome, value = "reject", None
        for p in alternatives:
            got, got_value = _evaluate(load(p), estimate_output_tokens, False, read_only)
            if got != "reject":
                chosen, outcome, value = p, got, got_value
                break
    plan = load(chosen)
    retry = -1
    if outcome in ("reject", "unvouched"):
        if outcome == "reject":
            retry = _retry_of(plan, False, now_ms)
        for x in plan:
            x.own = 0
    elif outcome == "observe_reject":
        retry = _retry_of(plan, True, now_ms)
    return DecisionResult(
        outcome=outcome,  # type: ignore[arg-type]
        plan=chosen,
        retry_after_ms=retry if retry >= 0 else None,
        never_fits=retry == NEVER_FITS,
        max_output_tokens=value if outcome == "cap" and isinstance(value, int) else None,
        keys=tuple(_view(x, now_ms, read_only) for x in plan),
    )
