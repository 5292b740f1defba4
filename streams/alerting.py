"""Pure alert rules: threshold crossings, exhaustion, expired reservations and overages."""

from __future__ import annotations

import functools
from datetime import UTC, datetime

from spendgate.schemas import windows
from spendgate.schemas.alerts import Alert, AlertKind, alert_id
from spendgate.schemas.forecast import forecast
from spendgate.streams.ledger import KeyedRecord, KeyState


def _line(state: KeyState, name: str, crossed: bool) -> int | None:
    """Track one alert line; return the crossing number when it was just crossed."""
    if not crossed:
        state.above.discard(name)  # re-armed: the next crossing fires again
        return None
    if name in state.above:
        return None
    seq = state.crossings.get(name, 0)
    state.crossings[name] = seq + 1
    state.above.add(name)
    return seq


def evaluate(
    state: KeyState, rec: KeyedRecord, overage: tuple[int, int, int] | None = None
) -> list[Alert]:
    """Alerts due after ``rec`` was applied to ``state`` (updates the bookkeeping in place).

    Usage is the window total at the key's clock (``state.high_ms``) with the policy's
    boundary. A threshold fires once per crossing of ``threshold x limit`` and re-arms when
    usage falls back under it; ``exhausted`` likewise at ``limit``; ``forecast`` (when the
    policy sets a horizon) likewise while the burn-rate forecast (``schemas.forecast``, at
    the key's clock) puts exhaustion within the horizon; a reservation still
    open when the key's clock passes its expiry is reported once. ``overage`` (the
    ``Change.overage`` of a commit above its reservation: estimate, reserved, actual) is
    reported once per reservation (its id makes the alert id, so a replay re-emits it).
    """
    at_ms = state.high_ms
    used = windows.total(rec.spec, state.buckets, at_ms)
    alerts: list[Alert] = []

    def emit(
        kind: AlertKind,
        threshold: float | None,
        seq: int,
        ref: str | None = None,
        exhausts_in_s: int | None = None,
    ) -> None:
        alerts.append(
            Alert(
                alert_id=alert_id(rec.policy, rec.key, kind, threshold, seq, ref),
                kind=kind,
                policy=rec.policy,
                key=rec.key,
                threshold=threshold,
                used=used,
                limit=rec.limit,
                at=datetime.fromtimestamp(at_ms / 1000, UTC),
                reservation_id=ref,
                exhausts_in_seconds=exhausts_in_s,
            )
        )

    if overage is not None:
        estimate, reserved, actual = overage
        ref = rec.reservation_id
        alerts.append(
            Alert(
                alert_id=alert_id(rec.policy, rec.key, "overage", None, 0, ref),
                kind="overage",
                policy=rec.policy,
                key=rec.key,
                used=used,
                limit=rec.limit,
                at=datetime.fromtimestamp(rec.occurred_ms / 1000, UTC),
                reservation_id=ref,
                estimate=estimate,
                reserved=reserved,
                actual=actual,
            )
        )
    for threshold in rec.thresholds:
        seq = _line(state, _line_name(threshold), used * 1.0 >= threshold * rec.limit)
        if seq is not None:
            emit("threshold", threshold, seq)
    seq = _line(state, "exhausted", used >= rec.limit)
    if seq is not None:
        emit("exhausted", None, seq)
    if rec.forecast_ms:
        ahead = forecast(
            rec.spec, state.buckets, at_ms, limit=rec.limit, horizon_ms=rec.forecast_ms
        ).exhausts_in_ms
        soon = ahead is not None and ahead <= rec.forecast_ms
        seq = _line(state, "forecast", soon)
        if seq is not None:
            emit("forecast", None, seq, None, -(-(ahead or 0) // 1000))
    if state.reservations:
        due = [
            rid
            for rid, held in state.reservations.items()
            if 0 < held.expires_ms <= at_ms and rid not in state.expired
        ]
        for rid in sorted(due):
            state.expired.add(rid)
            emit("reservation_expired", None, 0, rid)
    return alerts


@functools.lru_cache(maxsize=1024)
def _line_name(threshold: float) -> str:
    """The bookkeeping name of one threshold's alert line (as stored in the table)."""
    return f"t{threshold!r}"
