"""The token-bucket engine of a policy's ``burst``: pure integer arithmetic, time as an argument.

A bucket holds at most ``capacity`` tokens and refills continuously at ``rate`` tokens per
``per_ms``. The level is kept scaled by ``per_ms`` (``tokens * per_ms``), so a refill of
``elapsed_ms`` adds exactly ``elapsed_ms * rate`` and every quantity is an integer: the
Lua twin (``schemas/burst.lua``) computes the same numbers with doubles, exact below
2**53 (the policy refuses a ``capacity * per`` beyond it).

A missing state is a full bucket: the stored state expires when the bucket would be full,
and after a Redis loss the bucket starts full again (it limits bursts, not spend; the
rolling window still holds the allowance).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BurstCheck",
    "BurstSpec",
    "BurstState",
    "check",
    "decode_state",
    "encode_state",
    "full_after_ms",
    "level_at",
    "take",
]


@dataclass(frozen=True, slots=True)
class BurstSpec:
    """``rate`` tokens per ``per_ms``, at most ``capacity`` tokens."""

    rate: int
    per_ms: int
    capacity: int

    @property
    def full(self) -> int:
        """The scaled level of a full bucket (``capacity * per_ms``)."""
        return self.capacity * self.per_ms

    def encode(self) -> str:
        """The admit script's ``burst`` entry: ``rate:per_ms:capacity``."""
        return f"{self.rate}:{self.per_ms}:{self.capacity}"


@dataclass(frozen=True, slots=True)
class BurstState:
    """The scaled ``level`` as of ``at_ms``."""

    level: int
    at_ms: int


@dataclass(frozen=True, slots=True)
class BurstCheck:
    """One request against a bucket at one instant.

    Attributes:
        level: the scaled level now.
        fits: the request's tokens are there now.
        wait_ms: milliseconds until they are (0 when ``fits``; meaningless when ``never_fits``).
        never_fits: the request alone exceeds ``capacity``.
    """

    level: int
    fits: bool
    wait_ms: int
    never_fits: bool

    def tokens(self, spec: BurstSpec) -> int:
        """Whole tokens available now."""
        return self.level // spec.per_ms


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def level_at(spec: BurstSpec, state: BurstState | None, now_ms: int) -> int:
    """The scaled level at ``now_ms`` (a clock that went back refills nothing)."""
    if state is None:
        return spec.full
    need = spec.full - state.level
    if need <= 0:
        return spec.full
    elapsed = max(0, now_ms - state.at_ms)
    if elapsed >= _ceil_div(need, spec.rate):
        return spec.full
    return state.level + elapsed * spec.rate


def full_after_ms(spec: BurstSpec, level: int) -> int:
    """Milliseconds until a bucket at scaled ``level`` is full again."""
    return max(0, _ceil_div(spec.full - level, spec.rate))


def check(spec: BurstSpec, state: BurstState | None, now_ms: int, amount: int) -> BurstCheck:
    """Whether ``amount`` tokens are available at ``now_ms``, and if not, when."""
    level = level_at(spec, state, now_ms)
    if amount > spec.capacity:
        return BurstCheck(level, False, 0, True)
    cost = amount * spec.per_ms
    if level >= cost:
        return BurstCheck(level, True, 0, False)
    return BurstCheck(level, False, _ceil_div(cost - level, spec.rate), False)


def take(spec: BurstSpec, level: int, now_ms: int, amount: int) -> BurstState:
    """The state after ``amount`` tokens are taken from scaled ``level`` at ``now_ms``.

    An ``observe`` policy takes what it does not have: the level stops at empty (the
    bucket is a limiter, not a ledger; the window keeps the debt).
    """
    return BurstState(max(0, level - min(amount, spec.capacity) * spec.per_ms), now_ms)


def encode_state(state: BurstState) -> str:
    """The Redis value of a bucket: ``level:at_ms``."""
    return f"{state.level}:{state.at_ms}"


def decode_state(raw: bytes | str | None) -> BurstState | None:
    """The state stored by :func:`encode_state`, or None (a full bucket)."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    level, _, at = text.partition(":")
    return BurstState(int(level), int(at))
