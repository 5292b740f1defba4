"""``spendgate simulate``: replay the usage and refusals history against draft policies.

Nothing is written anywhere: the topics are read with manually assigned consumers (no group,
no committed offsets), the windows live in this process, Redis is never opened.

How a history becomes a counterfactual (the same pure fold as ``replay``,
``streams.fold.fold_usage``, keeps every draft key's windows):

* ``budget.usage`` and ``budget.refusals`` are read from ``--from`` (default: the beginning)
  to their current ends and merged by event time (``occurred_at`` / ``at``; ties keep topic
  order), records after ``--to`` left out.
* Each request — an admitted ``reserve``, or a refusal (the first one of its
  ``request_id``; a retry is not new demand) — is judged at its instant against every
  matching draft policy at once, as the admit script judges: a key fits when its window
  total (everything folded so far, reservations included) plus the request's amount is
  within the limit; ``observe`` policies never refuse; an ``enforce`` policy that does not
  fit refuses the whole request (nothing is charged anywhere) unless it is a ``cap``
  policy whose unit depends on output tokens and some output still fits every key: then
  the request is admitted with its output capped (:func:`judge`).
* A request the draft refuses contributes nothing afterwards: its reserve is not folded,
  and its commit, extends and release are dropped. A capped request's reserve and commit
  are folded with their output tokens at most the cap. An admitted refusal (refused live,
  admitted by the draft) is folded as a reservation of its estimate that nothing settles:
  it stays charged, as an abandoned reservation does at expiry. Commits without a
  reservation and adjusts are folded as they happened.
* ``delay``: a request refused only by delay policies is admitted at the instant it fits
  (the exact Retry-After over the windows as they stand, no new usage assumed) when that
  lies within the smallest ``max_delay`` among them, judged again there, and charged at
  that instant; ``downgrade``/``route``: a request refused only by policies offering an
  alternative is judged again for each alternative subject (model or pool replaced) in
  order, never chained; the first that fits is admitted and it, its commit, extends and
  release are charged to the replaced subject.
* Every request is decided by the admit script's pure twin (``schemas.decision``, checked
  against the script on random cases), so alternatives, caps, observe keys, bursts and the
  delay's Retry-After follow enforcement's own rules. A commit takes effect at its instant
  (live admission sees the estimate until the worker absorbed it: see ``caveats``).
* ``burst``: each key's token bucket (``schemas.burst``) is a second quota beside the
  window, judged in the same step (a ``cap`` caps to what both allow, a ``delay`` waits for
  both); an admitted request takes its amount from the buckets of the plan admitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from datetime import datetime

from spendgate.schemas import kafka_connect
from spendgate.schemas.policies import Policy
from spendgate.simulate_report import Report, chart, dumps
from spendgate.simulation import Merged, Simulation, caveats, event_ms, judge
from spendgate.streams.kafka_util import assign, partitions, stop
from spendgate.streams.settings import WorkerSettings

__all__ = [
    "Report",
    "caveats",
    "chart",
    "dumps",
    "judge",
    "read_history",
    "run_simulation",
    "simulate",
]

Progress = Callable[[int, int], None]


async def _read_topic(
    settings: WorkerSettings, name: str, since_ms: int | None, topic: int, out: list[Merged]
) -> None:
    consumer = kafka_connect.consumer(
        settings.kafka(), enable_auto_commit=False, max_poll_records=5000
    )
    await consumer.start()
    try:
        tps = await partitions(consumer, settings.topic(name))
        if not tps:
            return
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        start = {tp: 0 for tp in tps}
        if since_ms is not None:
            found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
            start = {tp: (found[tp].offset if found[tp] else end[tp]) for tp in tps}
        for tp in tps:
            consumer.seek(tp, start[tp])
        remaining = {tp for tp in tps if start[tp] < end[tp]}
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=1000)
            for tp, messages in batch.items():
                for m in messages:
                    if m.offset < end[tp]:
                        value = m.value or b""
                        at = event_ms(topic, value, m.timestamp)
                        out.append(Merged(at, len(out), topic, m.timestamp, value))
                if messages and messages[-1].offset + 1 >= end[tp]:
                    remaining.discard(tp)
    finally:
        await stop(consumer)


async def read_history(
    settings: WorkerSettings, *, since: datetime | None = None, until: datetime | None = None
) -> list[Merged]:
    """``usage`` and ``refusals`` from ``since`` (broker time) to their current ends, merged
    by event time (ties keep topic order), records after ``until`` left out."""
    since_ms = None if since is None else int(since.timestamp() * 1000)
    records: list[Merged] = []
    await _read_topic(settings, "usage", since_ms, 0, records)
    await _read_topic(settings, "refusals", since_ms, 1, records)
    until_ms = None if until is None else int(until.timestamp() * 1000)
    if until_ms is not None:
        records = [r for r in records if r.at_ms <= until_ms]
    records.sort(key=lambda r: (r.at_ms, r.order))
    return records


async def simulate(
    settings: WorkerSettings,
    draft: Sequence[Policy],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    progress: Progress | None = None,
) -> Report:
    """Replay ``usage`` and ``refusals`` against ``draft``; nothing is written anywhere.

    Args:
        settings: where the topics are (and the prices file, the dedupe horizon).
        draft: the draft policies (see :func:`caveats` for what is left out); exact
            values on secret fields are taken as key ids (``KeyIds.policy``).
        since: read from this time (broker time; default: the beginning).
        until: leave out records whose event time is later.
        progress: called with (records folded, records to fold).

    Raises:
        PolicyError: a draft policy has a glob on a secret field.
    """
    from spendgate.schemas.prices import load_catalog

    key_ids = settings.key_ids()
    draft = [key_ids.policy(p) for p in draft]
    started = asyncio.get_running_loop().time()
    records = await read_history(settings, since=since, until=until)
    prices = load_catalog(settings.prices_file) if settings.prices_file else None
    longest = max((p.window_ms for p in draft), default=0)
    sim = Simulation(draft, prices, settings.horizon_ms(longest), key_ids)
    try:
        for n, item in enumerate(records, 1):
            sim.feed(item)
            if progress is not None and (n % 2000 == 0 or n == len(records)):
                progress(n, len(records))
        sim.finish()
    finally:
        sim.close()
    sim.report.seconds = asyncio.get_running_loop().time() - started
    sim.report.keys_folded = len(sim.states)
    return sim.report


def run_simulation(
    settings: WorkerSettings,
    draft: Sequence[Policy],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    progress: Progress | None = None,
) -> Report:
    """Synchronous wrapper of :func:`simulate` for the CLI."""
    return asyncio.run(simulate(settings, draft, since=since, until=until, progress=progress))
