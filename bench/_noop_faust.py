"""Baseline child: a faust app whose one agent takes batches and acks them, doing nothing else.

The floor of any faust worker on the topic: ``stream.noack().noack_take(n, within)``, then
``ack`` of every event of the batch (what a batch fold must do once its effects are
written). When it has seen ``events`` records it writes ``{"n", "seconds", "first_batch"}``
to ``out`` and idles until the parent stops it: ``n`` records timed over ``seconds``, from
the end of the first batch (its ``first_batch`` records are not timed) to the last record.
When the first batch holds every record, it writes at once with ``n`` 0: nothing was timed.

Run by ``bench.processor``: ``python -m bench._noop_faust SPEC.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import faust


def build(spec: dict[str, Any]) -> faust.App:
    """The app: one agent on ``spec['topic']``, settings as ``streams.app`` has them."""
    app = faust.App(
        spec["app_id"],
        broker=f"kafka://{spec['bootstrap']}",
        store="memory://",
        datadir=spec["data_dir"],
        topic_partitions=spec["partitions"],
        topic_replication_factor=1,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
    )
    usage = app.topic(spec["topic"], value_serializer="raw", key_serializer="raw")
    out = Path(spec["out"])

    @app.agent(usage, concurrency=1)
    async def noop(stream: Any) -> None:
        seen, counted, first, done = 0, 0, 0.0, False
        batches = stream.noack()
        async for events in batches.noack_take(spec["batch"], within=spec["within_s"]):
            for event in events:
                await batches.ack(event)
            seen += len(events)
            if not first:
                # Timed from the end of the first batch, as the worker from its first record.
                first, counted = time.perf_counter(), seen
            if seen >= spec["events"] and not done:
                # Also when that first batch held every record (then nothing was timed).
                done, elapsed = True, time.perf_counter() - first
                result = {"n": seen - counted, "seconds": elapsed, "first_batch": counted}
                # Once, at the end of the measurement: the blocking write times nothing.
                out.write_text(json.dumps(result))  # noqa: ASYNC240

    return app


if __name__ == "__main__":
    app = build(json.loads(Path(sys.argv[1]).read_text()))
    faust.Worker(app, loglevel="warning").execute_from_commandline()
