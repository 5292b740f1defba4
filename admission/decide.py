"""Admission decisions without I/O: plans from indexed policies, cap terms, answers.

Everything here is a function of its arguments (policies, the subject, the estimate, what
the admit script returned, the in-process ledger): no Redis, no Kafka, no clock unless
given, so it is unit-tested without services. The routes (:mod:`admission.app`,
:mod:`admission.admit`) call it around one store call (:mod:`admission.store`).

Decisions (``POST /v1/admit``), over every policy matching the subject, in one Lua script:

* every key fits: ``allow``; only ``observe`` policies exceeded: ``observe_reject`` (200,
  everything reserved, ``violated`` and ``retry_after_seconds`` say what would have
  happened);
* an enforce policy with ``on_exceed: reject`` exceeded (or a cap/downgrade that cannot
  help): ``reject`` (429), nothing reserved anywhere;
* only ``cap`` policies exceeded: reserve with the largest output that fits every key,
  answered as ``max_output_tokens`` (see :func:`cap_terms` for each unit);
* a ``downgrade`` or ``route`` policy exceeded (and no reject): the same request with the
  model replaced by ``downgrade_to`` (or the pool by ``route_to``) is checked against the
  policies matching that subject; alternatives are tried in order, never chained;
* a ``delay`` policy exceeded: the script refuses; :mod:`admission.delay` holds the request
  and decides again when it fits (:func:`admission.delay.waitable_ms` says when it may);
* a policy's ``burst``: its token bucket refuses beside the window (same ``on_exceed``).

Redis unreachable, or a window it cannot vouch for: the strictest failure mode among the
keys concerned wins (closed > degraded > open); see :func:`fallback_answer`.
"""

from __future__ import annotations

from spendgate.admission.answers import (
    Answer,
    UnvouchedKeys,
    answer_of,
    ratelimit_headers,
    statuses,
    unvouched_of,
    worst,
)
from spendgate.admission.fallback import FallbackAnswer, fallback_answer
from spendgate.admission.plans import (
    CapTerms,
    Charge,
    Plan,
    PlanKind,
    Planner,
    PolicyTerms,
    alternative_of,
    build_plans,
    cap_terms,
)
from spendgate.admission.scripts.admit import AdmitResult, KeyState
from spendgate.admission.scripts.codes import Outcome, State

__all__ = [
    "AdmitResult",
    "Answer",
    "CapTerms",
    "Charge",
    "FallbackAnswer",
    "KeyState",
    "Outcome",
    "Plan",
    "PlanKind",
    "Planner",
    "PolicyTerms",
    "State",
    "UnvouchedKeys",
    "alternative_of",
    "answer_of",
    "build_plans",
    "cap_terms",
    "fallback_answer",
    "ratelimit_headers",
    "statuses",
    "unvouched_of",
    "worst",
]
