"""Admission of a request whose budget keys span Redis Cluster shards, piece by piece.

A request's keys usually share its tenant's home shard (``schemas.layout``), and then it is
one ADMIT call there. A budget not grouped by tenant (a global model or pool budget) lives
on its own key's shard, so a request matching it spans shards: no script can see all of
its keys at once. The protocol keeps the invariant "never over any limit":

* **Pieces in one order.** The plan's keys are grouped by shard and the shards visited in
  ascending order. Each piece is ADMIT in piece mode over that shard's keys: decided and
  held atomically with that shard's marks, listed in the shard's provisional set with a
  deadline (now + ``BudgetStore.piece_grace_ms``) and a piece record naming its keys.
* **A later refusal releases the earlier pieces** (their pending entries removed, as the
  worker's ABSORB removes an absorbed reservation's), then the refusal is answered. Until
  the release, a concurrent request may be refused spuriously; none is ever admitted over.
  The shards after the refusing one are only evaluated (read-only), so the answer lists
  every budget.
* **The commit point** is SEAL on the home shard, written last: the reservation record,
  the stored answer (the merged one) and the unpublished reserve in one step, refused when
  a tombstone exists. A retry of the request id reads the home shard's stored answer
  first; one that raced this request gets that answer back and releases its own pieces.
* **A crash between shards** leaves pieces unsealed: each shard's sweeper
  (``admission.sweeper``) takes the pieces past their deadline, writes the tombstone on
  the home shard unless the record is there (sealed: the piece only leaves the list), and
  then releases them, within the deadline plus a sweep interval.

The actions across shards: ``reject``, ``observe`` and ``delay`` (which repeats admits)
need nothing more. ``cap``: each piece is decided with the output the earlier pieces left
(it can only lower it) and holds its amounts at that output; a cap lowered by a later
piece leaves the earlier ones holding more than the final amount until the worker
absorbs the reserve (over, never under). ``downgrade`` and ``route``: plan by plan; the
asked plan's pieces decide with their alternatives off, and when every refusal came from
keys offering one, the alternatives are tried in order as whole plans of their own, each
released before the next. ``burst``: a bucket lives beside its window, in its piece; the
tokens a released piece took are not given back (the bucket refills at its rate), so a
release can only refuse more, never admit more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spendgate.admission.exceptions import Overloaded, StoreUnavailable
from spendgate.admission.metrics import CROSS_SHARD
from spendgate.admission.plans import Charge, Plan, PolicyTerms
from spendgate.admission.reserves import IDEMPOTENCY_TTL_MS, RECORD_GRACE_MS
from spendgate.admission.scripts import extend as extend_script
from spendgate.admission.scripts import seal as seal_script
from spendgate.admission.scripts.admit import AdmitCall, AdmitHeader, AdmitResult, KeyState
from spendgate.admission.scripts.codes import ON_EXCEED
from spendgate.admission.scripts.extend import ExtendArgs, ExtendResult
from spendgate.admission.scripts.seal import SealArgs, SealReply
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.redis_keys import (
    extend_key,
    held_keys,
    marks_key,
    piece_key,
    provisional_key,
    request_key,
    reservation_key,
    tombstone_key,
    unpublished_reserves_key,
    utilization_key,
    window_version_key,
)
from spendgate.schemas.redis_values import ReservationRecord, decode_answer, encode_answer
from spendgate.streams.scripts import absorb
from spendgate.streams.scripts.absorb import AbsorbArgs, AbsorbKey

if TYPE_CHECKING:
    from spendgate.admission.store import BudgetStore

__all__ = ["Piece", "admit_across", "extend_across", "merge", "release_args", "seal", "split"]

logger = logging.getLogger(__name__)

#: ADMIT's code of "try the alternative" (downgrade, route).
_ALTERNATIVE = ON_EXCEED["downgrade"]


@dataclass(frozen=True, slots=True)
class Piece:
    """One shard's part of a plan: its charges and where each sits in the plan."""

    shard: int
    charges: tuple[Charge, ...]
    positions: tuple[int, ...]


def split(store: BudgetStore, plan: Plan) -> list[Piece]:
    """The plan's charges grouped by virtual shard, in ascending shard order."""
    groups: dict[int, list[int]] = {}
    for i, charge in enumerate(plan.charges):
        groups.setdefault(store.shard_of(charge), []).append(i)
    return [
        Piece(shard, tuple(plan.charges[i] for i in positions), tuple(positions))
        for shard, positions in sorted(groups.items())
    ]


def merge(
    plan: Plan, plan_index: int, reservation_id: str, decided: Sequence[tuple[Piece, AdmitResult]]
) -> AdmitResult:
    """One answer from every piece's: the strictest outcome (unvouched, reject, cap,
    observe_reject, allow), the longest wait among the pieces that gave it, the lowest
    cap, each key's state in plan order (nothing own when nothing stays reserved)."""
    outcomes = {r.outcome for _, r in decided}
    outcome = next(
        o for o in ("unvouched", "reject", "cap", "observe_reject", "allow") if o in outcomes
    )
    if outcome == "cap" and "observe_reject" in outcomes:
        waits = [r for _, r in decided if r.outcome == "observe_reject"]
    else:
        waits = [r for _, r in decided if r.outcome == outcome]
    never = any(r.never_fits for r in waits)
    retries = [r.retry_after_ms for r in waits if r.retry_after_ms is not None]
    caps = [r.max_output_tokens for _, r in decided if r.max_output_tokens is not None]
    keys: list[KeyState | None] = [None] * len(plan.charges)
    for piece, result in decided:
        for position, state in zip(piece.positions, result.keys, strict=True):
            keys[position] = state
    held = outcome not in ("reject", "unvouched")
    states = tuple(k if held or k is None else dataclasses.replace(k, own=0) for k in keys)
    if any(k is None for k in states):
        raise ValueError("merge: a key of the plan has no piece")
    return AdmitResult(
        replayed=False,
        outcome=outcome,
        now_ms=max(r.now_ms for _, r in decided),
        retry_after_ms=None if never or not retries else max(retries),
        never_fits=never,
        reservation_id=reservation_id,
        plan=plan_index,
        max_output_tokens=min(caps) if outcome == "cap" and caps else None,
        keys=states,  # type: ignore[arg-type]
    )


def release_args(prefix: str, budget_keys: Sequence[str], reservation_id: str) -> AbsorbArgs:
    """ABSORB over a piece's keys with no window to write: the reservation's pending
    entries leave them (idempotent: an entry already gone moves nothing)."""
    parts = []
    for key in budget_keys:
        window, pending, total, queue, entries, _ = held_keys(prefix, key)
        parts.append(
            AbsorbKey(
                window_key=window,
                pending_window_key=pending,
                pending_total_key=total,
                pending_queue_key=queue,
                pending_reservations_key=entries,
                version_key=window_version_key(prefix, key),
                utilization_key=utilization_key(prefix),
                window=None,
                # Only the PX of a window written: none is.
                window_ms=1,
                reservation_ids=(reservation_id,),
            )
        )
    return AbsorbArgs(parts)


async def release_piece(
    store: BudgetStore, shard_prefix: str, budget_keys: Sequence[str], reservation_id: str
) -> None:
    """Release one piece: its pending entries, then its provisional entry and record."""
    args = release_args(shard_prefix, budget_keys, reservation_id)
    await store.run("release piece", absorb.SCRIPT, args.keys(), args.argv())
    await _forget(store, [shard_prefix], reservation_id)


async def _release_all(store: BudgetStore, reservation_id: str, pieces: Sequence[Piece]) -> bool:
    """Release every piece held, concurrently; a failure is left to the sweepers.

    Returns:
        Whether every piece was released now (False: one stays listed until a sweeper
        releases it, so no other plan may seal under this reservation id meanwhile: the
        sweeper would then take the record for this plan's and only unlist the piece).
    """
    layout = store.layout

    async def one(piece: Piece) -> bool:
        keys = [c.target.key for c in piece.charges]
        try:
            await release_piece(store, layout.shard(piece.shard), keys, reservation_id)
        except (StoreUnavailable, Overloaded) as exc:
            # Listed as provisional still: the shard's sweeper releases it past its deadline.
            logger.warning(
                "release of piece %s on shard %d deferred: %s", reservation_id, piece.shard, exc
            )
            return False
        return True

    return all(await asyncio.gather(*(one(p) for p in pieces)))


async def _unlist(store: BudgetStore, reservation_id: str, pieces: Sequence[Piece]) -> None:
    """After a seal: the other shards' provisional entries and piece records go (their
    holds stay until the worker absorbs the reserve), in one pipeline (a round trip per
    node); a failure is left to the sweepers."""
    if not pieces:
        return
    # Never fails the answer: the reservation is sealed whatever happens here.
    with contextlib.suppress(StoreUnavailable, Overloaded):
        await _forget(store, [store.layout.shard(p.shard) for p in pieces], reservation_id)


async def _forget(store: BudgetStore, shard_prefixes: Sequence[str], reservation_id: str) -> None:
    """Unlist a reservation's pieces on these shards: provisional entry and piece record."""
    client = store.client

    async def send() -> object:
        pipe = client.pipeline(transaction=False)
        for prefix in shard_prefixes:
            pipe.zrem(provisional_key(prefix), reservation_id)
            pipe.delete(piece_key(prefix, reservation_id))
        return await pipe.execute()

    await store._call("unlist pieces", send)


async def _decide_piece(
    store: BudgetStore,
    piece: Piece,
    plan: Plan,
    request_id: str,
    reservation_id: str,
    output_tokens: int,
    *,
    hold: bool,
    estimate_output: int,
) -> AdmitResult:
    """ADMIT on one shard over the piece's keys: in piece mode (``hold``) or read-only,
    at ``output_tokens`` (below ``estimate_output``: the cap earlier pieces set)."""
    prefix = store.layout.shard(piece.shard)
    charges = piece.charges
    if output_tokens < estimate_output:
        # An earlier piece capped the output: this one holds its amounts at that output.
        charges = tuple(_at_output(c, output_tokens) for c in charges)
    call = AdmitCall(
        request_key(prefix, plan.subject.tenant, request_id),
        piece_key(prefix, reservation_id),
        provisional_key(prefix),
        marks_key(prefix),
    )
    part = Plan(plan.subject, charges, plan.kind)
    record_ttl_ms, marks = store.add_plans(call, prefix, [part], alternatives=False)
    header = AdmitHeader(
        read_only=not hold,
        reservation_id=reservation_id,
        idempotency_ttl_ms=store.piece_grace_ms,
        record_ttl_ms=record_ttl_ms,
        estimate_output_tokens=output_tokens,
        estimate_json=json.dumps([c.target.key for c in piece.charges]),
        plans=1,
        staleness_ms=store.staleness_ms,
        marks=marks,
        piece=hold,
    )
    keys, args = call.finish(header)
    raw = await store._call("admit piece", lambda: store.run_admit(keys, args))
    return AdmitResult.decode(raw)


async def _attempt(
    store: BudgetStore,
    plan: Plan,
    plan_index: int,
    request_id: str,
    reservation_id: str,
    output_tokens: int,
    *,
    read_only: bool,
) -> tuple[AdmitResult, list[Piece], bool]:
    """Decide one plan piece by piece; returns the merged answer, the pieces still held
    (all of them when it admits; none after a refusal, which released them) and whether
    every release succeeded (``_release_all``)."""
    held: list[Piece] = []
    decided: list[tuple[Piece, AdmitResult]] = []
    out = output_tokens
    refused = read_only
    try:
        for piece in split(store, plan):
            result = await _decide_piece(
                store,
                piece,
                plan,
                request_id,
                reservation_id,
                out,
                hold=not refused,
                estimate_output=output_tokens,
            )
            decided.append((piece, result))
            if refused:
                continue
            if result.outcome in ("reject", "unvouched"):
                refused = True
                continue
            held.append(piece)
            if result.max_output_tokens is not None:
                out = min(out, result.max_output_tokens)
    except BaseException:
        await _release_all(store, reservation_id, held)
        raise
    merged = merge(plan, plan_index, reservation_id, decided)
    released = True
    if merged.outcome in ("reject", "unvouched") and held:
        released = await _release_all(store, reservation_id, held)
        held = []
    return merged, held, released


def _at_output(charge: Charge, output_tokens: int) -> Charge:
    """``charge`` with its amount at ``output_tokens`` (never above the amount asked)."""
    cap = charge.cap
    if cap.r == 0:
        return charge
    amount = -(-(cap.s + output_tokens * cap.r) // cap.d)
    return dataclasses.replace(charge, amount=min(charge.amount, amount))


def _alternatives(plan: Plan, result: AdmitResult) -> list[int]:
    """The plans to try after ``plan`` refused (as the admit script orders them): the
    alternatives of its refusing keys, in key order, when every refusing enforce key
    offers one or caps; none when any refuses outright."""
    out: list[int] = []
    for charge, key in zip(plan.charges, result.keys, strict=True):
        policy = charge.target.policy
        if not key.violated or policy.mode == "observe":  # observe keys never refuse
            continue
        on_exceed = ON_EXCEED[policy.on_exceed]
        if on_exceed == _ALTERNATIVE and charge.alt:
            if charge.alt not in out:
                out.append(charge.alt)
        elif on_exceed != ON_EXCEED["cap"]:
            return []
    return out


async def seal(
    store: BudgetStore, plan: Plan, request_id: str, result: AdmitResult, estimate: Usage
) -> SealReply:
    """SEAL the merged ``result`` of ``plan`` on its home shard (the commit point)."""
    layout = store.layout
    tenant = plan.subject.tenant
    home = layout.shard(layout.home_shard(tenant))
    rid = result.reservation_id
    terms = [c.terms or PolicyTerms.of(c.target.policy) for c in plan.charges]
    ttl_ms = max((t.reservation_ttl_ms for t in terms), default=0)
    call = SealArgs(
        answer_key=request_key(home, tenant, request_id),
        record_key=reservation_key(home, rid),
        unpublished_key=unpublished_reserves_key(home),
        tombstone_key=tombstone_key(home, rid),
        provisional_key=provisional_key(home),
        piece_key=piece_key(home, rid),
        reservation_id=rid,
        answer=encode_answer(result.answer_values()),
        answer_ttl_ms=IDEMPOTENCY_TTL_MS,
        record=ReservationRecord(
            subject_json=plan.subject.model_dump_json(exclude_defaults=True),
            plan=result.plan + 1,
            usage_json=estimate.model_dump_json(exclude_defaults=True),
            at_ms=result.now_ms,
            max_output_tokens=result.max_output_tokens,
            ttl_ms=ttl_ms,
        ),
        record_ttl_ms=ttl_ms + RECORD_GRACE_MS,
    )
    # A seal that fails (unknown whether it landed) leaves the pieces listed: the sweepers
    # find the record (sealed) or write the tombstone and release them.
    raw = await store.run("seal", seal_script.SCRIPT, call.keys(), call.argv(), durable=True)
    return SealReply.decode(raw)


def _replayed(raw: bytes | str) -> AdmitResult:
    return AdmitResult.decode(["1", *decode_answer(raw)])


async def admit_across(
    store: BudgetStore,
    request_id: str,
    reservation_id: str,
    plans: Sequence[Plan],
    estimate: Usage,
    *,
    read_only: bool = False,
) -> AdmitResult:
    """``BudgetStore.admit`` for a request whose keys span shards (this module's
    protocol); ``reservation_id`` already names the home shard.

    Raises:
        StoreUnavailable: a shard did not answer, or the request outlived its pieces'
            deadline (a sweeper aborted it): nothing stays reserved.
        Overloaded: this process is saturated (nothing stays reserved).
    """
    layout = store.layout
    tenant = plans[0].subject.tenant
    home = layout.shard(layout.home_shard(tenant))
    output_tokens = estimate.output_tokens
    if read_only:
        result, _, _ = await _attempt(
            store, plans[0], 0, request_id, reservation_id, output_tokens, read_only=True
        )
        return result
    answer_key = request_key(home, tenant, request_id)
    stored = await store._call("answer", lambda: store.client.get(answer_key))
    if stored is not None:
        return _replayed(stored)
    CROSS_SHARD.inc()
    result, held, released = await _attempt(
        store, plans[0], 0, request_id, reservation_id, output_tokens, read_only=False
    )
    plan_index = 0
    if result.outcome == "reject" and released:
        for alt in _alternatives(plans[0], result):
            if alt >= len(plans):
                continue
            tried, tried_held, released = await _attempt(
                store, plans[alt], alt, request_id, reservation_id, output_tokens, read_only=False
            )
            if tried.outcome != "reject":
                result, held, plan_index = tried, tried_held, alt
                break
            if not released:
                break
    if result.outcome in ("reject", "unvouched"):
        return result
    reply = await seal(store, plans[plan_index], request_id, result, estimate)
    if reply.status == "sealed":
        await _unlist(store, reservation_id, [p for p in held if layout.shard(p.shard) != home])
        return result
    await _release_all(store, reservation_id, held)
    if reply.status == "replayed":
        return AdmitResult.decode(["1", *reply.stored])
    raise StoreUnavailable(
        "the request outlived its pieces' deadline on another Redis Cluster shard and was "
        "aborted (nothing reserved); retry"
    )


async def extend_across(
    store: BudgetStore,
    entry: str,
    reservation_id: str,
    seq: int,
    subject: Subject,
    charges: Sequence[Charge],
) -> ExtendResult:
    """``BudgetStore.extend`` for a reservation whose keys span shards.

    The same order as an admit: a piece per shard in ascending order (EXTEND in piece
    mode, each atomic with its shard's marks, holding under the extend's entry), then the
    commit point on the home shard (EXTEND in seal mode: the record still open, the merged
    answer stored, a repeat of ``seq`` replayed). Every piece is decided even after one
    refuses, so the answer shows every budget; any refusal (or a record found settled or
    gone at the seal) releases every piece held. An admission process dying between the
    pieces and the seal leaves its holds to age out of their windows, as an extend whose
    event was never published does on one Redis: more counted for a while, never less.

    Raises:
        StoreUnavailable: a shard did not answer (the pieces held are released where
            possible).
        Overloaded: this process is saturated.
    """
    layout = store.layout
    home = layout.of_reservation(reservation_id)
    answer_key = extend_key(home, reservation_id, seq)
    stored = await store._call("extend answer", lambda: store.client.get(answer_key))
    if stored is not None:
        return ExtendResult.decode(["1", *decode_answer(stored)])
    groups: dict[int, list[int]] = {}
    for i, charge in enumerate(charges):
        groups.setdefault(store.shard_of(charge), []).append(i)
    held: list[tuple[str, list[Charge]]] = []
    states: list[KeyState | None] = [None] * len(charges)
    outcomes: set[str] = set()
    now_ms = 0
    try:
        for shard, positions in sorted(groups.items()):
            prefix = layout.shard(shard)
            part = [charges[i] for i in positions]
            call = store.extend_args(prefix, entry, reservation_id, seq, subject, part, "piece")
            result = ExtendResult.decode(
                await store.run(
                    "extend piece", extend_script.SCRIPT, call.keys(), call.argv(), durable=True
                )
            )
            outcomes.add(result.outcome)
            now_ms = max(now_ms, result.now_ms)
            if result.outcome == "allow":
                held.append((prefix, part))
            for position, state in zip(positions, result.keys, strict=True):
                states[position] = state
    except BaseException:
        await _release_extend(store, entry, held)
        raise
    outcome = (
        "unvouched" if "unvouched" in outcomes else "reject" if "reject" in outcomes else "allow"
    )
    keys = tuple(
        s if outcome == "allow" else dataclasses.replace(s, own=0) for s in states if s is not None
    )
    merged = ExtendResult(False, outcome, now_ms, keys)  # type: ignore[arg-type]
    if outcome != "allow":
        await _release_extend(store, entry, held)
        return merged
    seal_call = ExtendArgs(
        answer_key=answer_key,
        record_key=reservation_key(home, reservation_id),
        marks_key=marks_key(home),
        entry=entry,
        answer_ttl_ms=IDEMPOTENCY_TTL_MS,
        staleness_ms=store.staleness_ms,
        marks=(),
        targets=(),
        mode="seal" + encode_answer(merged.answer_values()),
    )
    raw = await store.run(
        "extend seal", extend_script.SCRIPT, seal_call.keys(), seal_call.argv(), durable=True
    )
    sealed = ExtendResult.decode(raw)
    if not sealed.replayed and sealed.outcome == "allow":
        return merged
    # Settled or gone meanwhile: nothing of ours stays. A repeat of this seq that sealed
    # first (racing us) answers instead; our holds share its entry's name, so releasing
    # them would take its entry too: they are left to age out (counted longer, never less).
    if not sealed.replayed:
        await _release_extend(store, entry, held)
    return sealed


async def _release_extend(
    store: BudgetStore, entry: str, held: Sequence[tuple[str, Sequence[Charge]]]
) -> None:
    """Remove an extend's holds (its pending entry) from every shard that took them."""

    async def one(prefix: str, part: Sequence[Charge]) -> None:
        args = release_args(prefix, [c.target.key for c in part], entry)
        try:
            await store.run("release extend", absorb.SCRIPT, args.keys(), args.argv())
        except (StoreUnavailable, Overloaded) as exc:
            # Left to age out of its windows (counted a while longer, never less).
            logger.warning("release of extend %s on %s failed: %s", entry, prefix, exc)

    await asyncio.gather(*(one(prefix, part) for prefix, part in held))
