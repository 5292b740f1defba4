"""Batches from a faust stream that keep filling while the previous batch is folded.

faust's ``Stream.noack_take`` stops taking events while the agent consumes a batch, so
under load the stream and the fold take turns: a batch is whatever arrives in the linger
*after* the previous one was written (a few dozen records), and every per-batch cost is
paid per few records. Here the stream keeps filling the next batch meanwhile (up to
``size``; beyond it the stream waits), so a busy worker folds large batches and an idle
one still folds a lone record within the linger.

Like ``noack_take``: events, not values, are yielded, and nothing is acked (the caller acks
each event after the batch's effects are written).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from faust.types import EventT, StreamT

__all__ = ["batches"]


async def batches(
    stream: StreamT[Any], size: int, linger_s: float
) -> AsyncIterator[list[EventT[Any]]]:
    """Batches of up to ``size`` events: at once when one is full, else once its first
    event has waited ``linger_s``; acked by the caller."""
    s: Any = stream  # faust's internals used here are not in StreamT
    pending: list[EventT[Any]] = []
    first = [0.0]  # monotonic time the oldest pending event arrived
    arrived, full, room = asyncio.Event(), asyncio.Event(), asyncio.Event()
    room.set()

    async def take(value: Any) -> Any:
        event = s.current_event
        if event is None:
            raise RuntimeError("batches: the stream has no current event")
        if not pending:
            first[0] = time.monotonic()
            arrived.set()
        pending.append(event)
        if len(pending) >= size:
            full.set()
            room.clear()
            await s.wait(room)
        return value

    enable_acks = s.enable_acks
    s.enable_acks = False
    s.add_processor(take)
    s._enable_passive(aiter(s.channel))
    try:
        while not s.should_stop:
            if not pending:
                arrived.clear()
                await s.wait_for_stopped(arrived)
                continue
            wait = first[0] + linger_s - time.monotonic()
            if len(pending) < size and wait > 0:
                await s.wait_for_stopped(full, timeout=wait)
            batch = pending[:]
            pending.clear()
            full.clear()
            room.set()
            yield batch
    finally:
        s.enable_acks = enable_acks
        s._processors.remove(take)
