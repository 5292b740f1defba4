"""``overage: cap_next``: the ratio an overage observed, decaying back to 1 over the window.

When a commit exceeds everything its reservation held, the worker records the key's
observed ratio ``actual / reserved`` (in thousandths, rounded up, at most
:data:`MAX_RATIO_MILLI`) with the commit's instant. For a policy with ``overage:
cap_next`` admission then scales the next requests' estimates on that key by the ratio,
decaying linearly back to 1 over one window of the policy: at ``age`` ms after the
overage the factor is ``1 + (ratio - 1) * (window - age) / window`` (rounded up), 1 once
a window has passed. So chronic under-estimation reserves what it really uses, and a
single outlier is forgotten as its usage ages out of the window. Pure: time is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MAX_RATIO_MILLI",
    "SCALED_FIELDS",
    "OverageMark",
    "factor_milli",
    "ratio_milli",
    "scaled",
]

#: The largest ratio recorded: 16x (one wild commit never blocks a key for a window).
MAX_RATIO_MILLI = 16_000
ONE = 1_000


def ratio_milli(reserved: int, actual: int) -> int:
    """``actual / reserved`` in thousandths, rounded up, within ``[1000, MAX_RATIO_MILLI]``."""
    if reserved <= 0:
        return MAX_RATIO_MILLI if actual > 0 else ONE
    return max(ONE, min(MAX_RATIO_MILLI, -((-actual * ONE) // reserved)))


@dataclass(frozen=True, slots=True)
class OverageMark:
    """The last overage of a key: its ratio (thousandths) and instant (ms)."""

    ratio_milli: int
    at_ms: int

    def encode(self) -> str:
        """The Redis value: ``"<ratio_milli>:<at_ms>"``."""
        return f"{self.ratio_milli}:{self.at_ms}"

    @classmethod
    def decode(cls, raw: bytes | str | None) -> OverageMark | None:
        """Inverse of :meth:`encode`; ``None`` for a missing or unreadable value."""
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        ratio, _, at = text.partition(":")
        try:
            return cls(int(ratio), int(at))
        except ValueError:
            return None


def factor_milli(mark: OverageMark | None, now_ms: int, window_ms: int) -> int:
    """The scale factor (thousandths, >= 1000) at ``now_ms`` of a key's last overage."""
    if mark is None or mark.ratio_milli <= ONE:
        return ONE
    left = window_ms - max(0, now_ms - mark.at_ms)
    if left <= 0:
        return ONE
    return ONE + -((-(mark.ratio_milli - ONE) * left) // window_ms)


#: The usage fields a factor scales (a request is still one request).
SCALED_FIELDS = (
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "gpu_ms",
    "cost_usd_micros",
)


def scaled(amounts: dict[str, int], factor: int) -> dict[str, int]:
    """The amounts of :data:`SCALED_FIELDS` times ``factor`` thousandths, rounded up; the
    others as they are."""
    return {k: -((-v * factor) // ONE) if k in SCALED_FIELDS else v for k, v in amounts.items()}
