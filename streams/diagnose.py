"""What a stalled worker shows: every task's stack and where its Kafka producer waits.

Logged on ``SIGUSR1``, on the first hit of any bound (``streams.retry``: a batch's Kafka
waits; ``streams.watchdog``: no progress), and before a self-exit, so that a stall in
production leaves what is needed to diagnose it:

- every asyncio task's stack (and every thread's, for a loop blocked in a call);
- whether aiokafka's sender task is alive, and its exception if it died;
- the batches held per partition in aiokafka's accumulator, with each partition's leader,
  and the partitions muted (a produce request in flight, waiting for its acks);
- the requests in flight per broker connection;
- faust's producer buffer size.

It reads aiokafka's and faust's private attributes (there is no public view of them), each
behind a guard: a missing attribute is reported as such, never raised.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

__all__ = ["report"]


def report(app: Any, loop: asyncio.AbstractEventLoop | None, why: str) -> str:
    """A multi-line report of the worker's state (``app``: the faust app, ``loop``: its
    event loop, read from any thread)."""
    out = [f"worker diagnostics ({why})"]
    out += _producer(app)
    out += _tasks(loop)
    out += _threads()
    return "\n".join(out)


def _producer(app: Any) -> list[str]:
    lines = ["-- kafka producer"]
    try:
        faust_producer = app.producer
    except Exception as exc:  # noqa: BLE001 - diagnostics never raise
        return [*lines, f"  no faust producer: {exc!r}"]
    buffer = getattr(faust_producer, "buffer", None)
    lines.append(f"  faust producer buffer: {getattr(buffer, 'size', 'n/a')} messages queued")
    producer = getattr(faust_producer, "_producer", None)
    if producer is None:
        return [*lines, "  aiokafka producer: not started"]
    sender = getattr(producer, "_sender", None)
    task = getattr(sender, "sender_task", None)
    if task is None:
        lines.append("  aiokafka sender task: none")
    elif not task.done():
        lines.append("  aiokafka sender task: alive")
    elif task.cancelled():
        lines.append("  aiokafka sender task: DEAD (cancelled)")
    else:
        lines.append(f"  aiokafka sender task: DEAD ({task.exception()!r})")
    client = getattr(producer, "client", None)
    cluster = getattr(client, "cluster", None)
    in_flight = sorted(getattr(sender, "_in_flight", ()) or ())
    lines.append(f"  produce requests in flight to brokers: {in_flight or 'none'}")
    muted = sorted(getattr(sender, "_muted_partitions", ()) or (), key=str)
    for tp in muted:
        lines.append(f"  waiting for acks: {_tp(tp)} leader {_leader(cluster, tp)}")
    accumulator = getattr(producer, "_message_accumulator", None)
    held = getattr(accumulator, "_batches", {}) or {}
    for tp, batches in sorted(held.items(), key=lambda item: str(item[0])):
        if batches:
            lines.append(
                f"  batches held: {_tp(tp)} {len(batches)} (leader {_leader(cluster, tp)})"
            )
    pending = getattr(accumulator, "_pending_batches", ()) or ()
    lines.append(f"  batches pending (sent, not yet answered): {len(pending)}")
    for node_id, conn in _conns(client):
        requests = getattr(conn, "_requests", ()) or ()
        lines.append(f"  broker {node_id}: {len(requests)} requests in flight")
    return lines


def _conns(client: Any) -> Iterator[tuple[Any, Any]]:
    conns = getattr(client, "_conns", {}) or {}
    for key, conn in list(conns.items()):
        node_id = key[0] if isinstance(key, tuple) else key
        yield node_id, conn


def _tp(tp: Any) -> str:
    return f"{getattr(tp, 'topic', tp)}[{getattr(tp, 'partition', '?')}]"


def _leader(cluster: Any, tp: Any) -> Any:
    try:
        return cluster.leader_for_partition(tp)
    except Exception:  # noqa: BLE001 - diagnostics never raise
        return "unknown"


def _tasks(loop: asyncio.AbstractEventLoop | None) -> list[str]:
    lines = ["-- asyncio tasks (each awaiting chain, outermost first)"]
    if loop is None:
        return [*lines, "  no event loop"]
    try:
        tasks = list(asyncio.all_tasks(loop))
    except RuntimeError as exc:  # the set changed while read from another thread
        return [*lines, f"  not readable now: {exc}"]
    for task in sorted(tasks, key=lambda t: t.get_name()):
        try:
            chain = _await_chain(task.get_coro())
        except Exception as exc:  # noqa: BLE001 - diagnostics never raise
            chain = [f"not readable: {exc!r}"]
        lines.append(f"task {task.get_name()}:")
        lines += [f"    {step}" for step in chain]
    return lines


def _await_chain(coro: Any) -> list[str]:
    """Where ``coro`` waits: each coroutine it awaits in turn (``Task.print_stack`` shows
    the outermost frame only), then the future at the end of the chain."""
    steps = []
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        frame = frame or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            steps.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        nxt = nxt or getattr(coro, "gi_yieldfrom", None)
        if nxt is None:
            break
        if isinstance(nxt, asyncio.Future):
            steps.append(f"waits for {nxt!r}"[:300])
            break
        coro = nxt
    return steps


def _threads() -> list[str]:
    lines = ["-- threads"]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame, limit=12))
        lines.append(f"thread {names.get(ident, ident)}:\n{stack.rstrip()}")
    return lines
