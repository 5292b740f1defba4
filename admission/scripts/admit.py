"""ADMIT's contract: its KEYS and ARGV built by role, its reply decoded (``admit.lua``).

A call is built plan by plan with :class:`AdmitCall`: the store names each target's keys
and hands its ARGV entries (a policy's :class:`TargetTemplate` filled in per request);
where each entry sits is this module's business only. :meth:`AdmitResult.decode` reads the
reply, a fresh one or a stored one replayed (every value then text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spendgate.admission.scripts.codes import (
    NEVER_FITS,
    OUTCOMES,
    STATES,
    Outcome,
    State,
)
from spendgate.schemas.luascript import as_text, load

__all__ = [
    "SCRIPT",
    "AdmitCall",
    "AdmitHeader",
    "AdmitResult",
    "AdmitTarget",
    "KeyState",
    "TargetTemplate",
    "encode_deps",
]

SCRIPT = load("spendgate.admission.scripts", "admit")

ArgValue = int | str


@dataclass(frozen=True, slots=True)
class AdmitHeader:
    """The ARGV entries of :data:`ADMIT` before the first plan, in ARGV order.

    Attributes:
        read_only: evaluate plan 1 only, reserve and store nothing.
        reservation_id: the id the reservation gets when one is made.
        idempotency_ttl_ms: how long the stored answer of the request id lives.
        record_ttl_ms: how long the reservation record lives.
        estimate_output_tokens: the estimate's output tokens (what ``cap`` lowers).
        estimate_json: the estimate as sent (JSON), kept in the reservation record so
            its ``reserve`` event can be rebuilt (``spendgate.admission.reserves``).
        plans: how many plans follow.
        staleness_ms: a mark older than this (Redis clock) is stale.
        marks: the mark fields (``schemas.shards``) the targets' ``deps`` refer to; they
            follow this header in ARGV, before the first plan.
        piece: one shard's part of a request whose keys span shards
            (``admission.shards``): decided and held as a request is, nothing stored but
            the piece record (``record_ttl_ms``, ``estimate_json`` its text) and its
            provisional entry (deadline: now + ``idempotency_ttl_ms``).
    """

    read_only: bool
    reservation_id: str
    idempotency_ttl_ms: int
    record_ttl_ms: int
    estimate_output_tokens: int
    estimate_json: str
    plans: int
    staleness_ms: int
    marks: tuple[str, ...]
    piece: bool = False

    def argv(self) -> list[ArgValue]:
        """The entries, encoded as the script reads them."""
        return [
            2 if self.piece else int(self.read_only),
            self.reservation_id,
            self.idempotency_ttl_ms,
            self.record_ttl_ms,
            self.estimate_output_tokens,
            self.estimate_json,
            self.plans,
            self.staleness_ms,
            len(self.marks),
            *self.marks,
        ]


@dataclass(frozen=True, slots=True)
class AdmitTarget:
    """The ARGV entries of one budget key of a plan in :data:`ADMIT`, in ARGV order.

    ``on_exceed``: 0 reject, 1 cap, 2 downgrade or route; ``downgrade_plan``: the 1-based index of
    the plan to try when this key refuses (0 none); the amount at ``o`` output tokens is
    ``ceil((cap_s + o * cap_r) / cap_d)``; ``deps``: the 1-based indexes into the header's
    ``marks`` this key's window depends on; ``failure``: the policy's failure mode, 0
    closed, 1 open, 2 degraded (what an unvouched window means); ``burst``: the policy's
    token bucket as ``rate:per_ms:capacity`` (``schemas.burst.BurstSpec.encode``), ``""``
    for none (a target with one has a fourth key, the bucket's state).
    """

    limit: int
    window_ms: int
    bucket_ms: int
    boundary: str
    amount: int
    reservation_ttl_ms: int
    observe: bool
    on_exceed: int
    downgrade_plan: int
    cap_s: int
    cap_r: int
    cap_d: int
    deps: tuple[int, ...]
    failure: int
    burst: str = ""

    def argv(self) -> list[ArgValue]:
        """The entries, encoded as the script reads them."""
        return [
            self.limit,
            self.window_ms,
            self.bucket_ms,
            self.boundary,
            self.amount,
            self.reservation_ttl_ms,
            int(self.observe),
            self.on_exceed,
            self.downgrade_plan,
            self.cap_s,
            self.cap_r,
            self.cap_d,
            encode_deps(self.deps),
            self.failure,
            self.burst,
        ]


@dataclass(frozen=True, slots=True)
class TargetTemplate:
    """:class:`AdmitTarget` with the entries that depend only on the policy encoded once.

    Built once per policy version; :meth:`argv` fills in what each request brings and
    gives exactly ``AdmitTarget(...).argv()`` for the same values (a test checks it).
    """

    head: tuple[ArgValue, ...]
    middle: tuple[ArgValue, ...]
    failure: int
    burst: str = ""

    @classmethod
    def of(
        cls,
        *,
        limit: int,
        window_ms: int,
        bucket_ms: int,
        boundary: str,
        reservation_ttl_ms: int,
        observe: bool,
        on_exceed: int,
        failure: int,
        burst: str = "",
    ) -> TargetTemplate:
        """The template of one policy (the same fields as :class:`AdmitTarget`)."""
        return cls(
            (limit, window_ms, bucket_ms, boundary),
            (reservation_ttl_ms, int(observe), on_exceed),
            failure,
            burst,
        )

    def argv(
        self,
        amount: int,
        downgrade_plan: int,
        cap_s: int,
        cap_r: int,
        cap_d: int,
        deps: str,
    ) -> list[ArgValue]:
        """The entries of one target; ``deps`` already joined (:func:`encode_deps`)."""
        return [
            *self.head,
            amount,
            *self.middle,
            downgrade_plan,
            cap_s,
            cap_r,
            cap_d,
            deps,
            self.failure,
            self.burst,
        ]


def encode_deps(deps: tuple[int, ...]) -> str:
    """The ``deps`` entry of a target: the mark indexes, comma-separated."""
    return ",".join(str(d) for d in deps)


#: Reply entries per budget key of the reported plan.
_REPLY_PER_TARGET = 6
#: Answers stored before the state entry existed have one entry less per key.
_LEGACY_REPLY_PER_TARGET = 5


class AdmitCall:
    """One ADMIT call's KEYS and ARGV, built in order: :meth:`plan`, then its
    :meth:`target` calls, for each plan; then :meth:`finish` with the header.

    Args:
        answer_key: the stored answer of this request id.
        record_key: the reservation record.
        unpublished_key: the unpublished reserves.
        marks_key: the applied marks.
    """

    __slots__ = ("_args", "keys")

    def __init__(
        self, answer_key: str, record_key: str, unpublished_key: str, marks_key: str
    ) -> None:
        self.keys = [answer_key, record_key, unpublished_key, marks_key]
        self._args: list[ArgValue] = []

    def plan(self, subject_json: str, targets: int) -> None:
        """Open a plan of ``targets`` targets for the subject (JSON, kept in the record)."""
        self._args += (subject_json, targets)

    def target(
        self, held_keys: Sequence[str], burst_key: str | None, argv: Sequence[ArgValue]
    ) -> None:
        """Add a target of the open plan: its keys (``redis_keys.held_keys``, and
        ``burst_key`` only when its policy has a burst) and its entries
        (:meth:`AdmitTarget.argv` or :meth:`TargetTemplate.argv`)."""
        keys = self.keys
        keys += held_keys
        if burst_key is not None:
            keys.append(burst_key)
        self._args += argv

    def finish(self, header: AdmitHeader) -> tuple[list[str], list[ArgValue]]:
        """KEYS and ARGV, the header's entries first."""
        return self.keys, header.argv() + self._args


@dataclass(frozen=True, slots=True)
class KeyState:
    """One key as the decision saw it."""

    used: int
    reserved: int
    own: int
    violated: bool
    reset_after_ms: int
    state: State = "vouched"
    #: With a ``burst``: whole tokens left and ms until the bucket is full again.
    burst: tuple[int, int] | None = None

    def values(self) -> tuple[int, ...]:
        """This key's entries of a reply's per-key part (what :meth:`decode_all` reads)."""
        return (
            self.used,
            self.reserved,
            self.own,
            int(self.violated),
            self.reset_after_ms,
            STATES.index(self.state),
        )

    @classmethod
    def decode_all(
        cls,
        values: Sequence[bytes | int | str],
        count: int,
        per: int = _REPLY_PER_TARGET,
        bursts: Mapping[int, tuple[int, int]] | None = None,
    ) -> tuple[KeyState, ...]:
        """The first ``count`` keys of a reply's per-key part (ADMIT's and EXTEND's layout:
        used, reserved by others, own, violated, reset_after_ms, state), ``per`` values
        each (5: an answer stored before the state existed, every key vouched)."""
        bursts = bursts or {}
        return tuple(
            cls(
                used=int(values[i]),
                reserved=int(values[i + 1]),
                own=int(values[i + 2]),
                violated=bool(int(values[i + 3])),
                reset_after_ms=int(values[i + 4]),
                state=STATES[int(values[i + 5])] if per == _REPLY_PER_TARGET else "vouched",
                burst=bursts.get(i // per),
            )
            for i in range(0, count * per, per)
        )


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """What the admit script decided, with the state of each key of the reported plan."""

    replayed: bool
    outcome: Outcome
    now_ms: int
    retry_after_ms: int | None
    never_fits: bool
    reservation_id: str
    plan: int
    max_output_tokens: int | None
    keys: tuple[KeyState, ...]

    @classmethod
    def decode(cls, raw: Sequence[bytes | int | str]) -> AdmitResult:
        """Decode ADMIT's reply (``plan`` becomes 0-based)."""
        replayed, outcome, now_ms, retry, rid, plan, max_out, n, *rest = raw
        retry = int(retry)
        count = int(n)
        per = (
            _REPLY_PER_TARGET
            if len(rest) >= count * _REPLY_PER_TARGET
            else _LEGACY_REPLY_PER_TARGET
        )
        # Then the keys with a token bucket (absent from answers stored before bursts).
        bursts: dict[int, tuple[int, int]] = {}
        tail = rest[count * per :]
        for i in range(1, 1 + 3 * int(tail[0]) if tail else 1, 3):
            bursts[int(tail[i]) - 1] = (int(tail[i + 1]), int(tail[i + 2]))
        states = KeyState.decode_all(rest, count, per, bursts)
        max_out = int(max_out)
        return cls(
            replayed=bool(int(replayed)),
            outcome=OUTCOMES[int(outcome)],
            now_ms=int(now_ms),
            retry_after_ms=retry if retry >= 0 else None,
            never_fits=retry == NEVER_FITS,
            reservation_id=as_text(rid),
            plan=int(plan) - 1,
            max_output_tokens=max_out if max_out >= 0 else None,
            keys=states,
        )

    def answer_values(self) -> list[int | str]:
        """The values ADMIT stores as this answer (its reply without ``replayed``):
        :meth:`decode` of ``[1, *values]`` gives this result back, replayed."""
        code = {name: c for c, name in OUTCOMES.items()}[self.outcome]
        if self.never_fits:
            retry = NEVER_FITS
        else:
            retry = -1 if self.retry_after_ms is None else self.retry_after_ms
        out = -1 if self.max_output_tokens is None else self.max_output_tokens
        values: list[int | str] = [
            code,
            self.now_ms,
            retry,
            self.reservation_id,
            self.plan + 1,
            out,
            len(self.keys),
        ]
        bursts: list[int] = []
        for i, key in enumerate(self.keys):
            values += key.values()
            if key.burst is not None:
                bursts += (i + 1, *key.burst)
        return [*values, len(bursts) // 3, *bursts]
