"""Run the stream processor as a process: topics, health endpoint, faust worker."""

from __future__ import annotations

import asyncio
import io
import logging
import signal
from typing import Any

from faust.worker import Worker

from spendgate.schemas.connections import check_connections
from spendgate.schemas.key_settings import announce
from spendgate.streams.app import build_app
from spendgate.streams.health import WorkerHealth
from spendgate.streams.health_server import HealthServer
from spendgate.streams.policybook import read_policies
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import check_usage, describe_usage, ensure_topics

logger = logging.getLogger(__name__)


def _dump_tasks(signum: int, frame: object) -> None:
    """On SIGUSR1, log where every asyncio task waits (a stuck worker's first clue)."""
    for task in asyncio.all_tasks(asyncio.get_event_loop()):
        out = io.StringIO()
        task.print_stack(limit=8, file=out)
        logger.warning("task %s:\n%s", task.get_name(), out.getvalue())


def run_worker(settings: WorkerSettings) -> None:
    """Check the credentials, create missing topics, serve ``/metrics``, ``/healthz`` and
    ``/readyz``, and run the faust worker until stopped."""
    key_ids = settings.key_ids()
    announce(key_ids, logger)
    asyncio.run(check_connections(settings.kafka(), settings.redis()))
    kafka = settings.kafka()
    asyncio.run(ensure_topics(settings))
    policies = asyncio.run(read_policies(kafka, settings.topic("policies"), key_ids=key_ids))
    logger.info("%d policies in force at start", len(policies))
    usage = asyncio.run(describe_usage(settings))
    longest = max((p.window_ms for p in policies.values()), default=0)
    check_usage(usage, settings, longest)
    keyed = asyncio.run(describe_usage(settings, settings.keyed_topic))
    if keyed.timestamp_type != "LogAppendTime":
        # Created before the keyed marks read append times (streams.marks): still safe
        # while the workers' clocks run no faster than Redis's plus the skew allowance.
        logger.warning(
            "topic %s stamps records with %s; set message.timestamp.type=LogAppendTime so "
            "its marks use the broker's clock, not the workers'",
            settings.keyed_topic,
            keyed.timestamp_type,
        )
    horizon = settings.horizon_ms(longest)
    if horizon < longest:
        logger.warning(
            "SPENDGATE_DEDUPE_HORIZON (%d ms) is shorter than the longest window (%d ms): "
            "a producer duplicate arriving later than the horizon counts again",
            horizon,
            longest,
        )
    health = WorkerHealth()
    if settings.metrics_port:
        HealthServer(health, settings.metrics_port, settings.metrics_host).start()
        logger.info(
            "metrics on http://%s:%s/metrics (and /healthz, /readyz)",
            settings.metrics_host,
            settings.metrics_port,
        )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = build_app(settings, policies, usage.retention_ms, health=health)
    signal.signal(signal.SIGUSR1, _dump_tasks)
    execute(Worker(app, loglevel="INFO", override_logging=False, quiet=True))


def execute(worker: Any) -> None:
    """Run mode's ``worker`` until it stops; exit 1 when no signal asked it to.

    mode exits 0 however the app stopped. A stop no signal asked for (a faust service that
    ended by itself: seen once, after two of three brokers were down for 12 s) must not look
    like a clean shutdown to a supervisor that restarts only on failure.
    """
    try:
        worker.execute_from_commandline()
    except SystemExit as done:
        # mode notes the instant of the signal that stops it (SIGINT, SIGTERM).
        if not done.code and worker._signal_stop_time is None:
            logger.error(
                "the worker stopped without a signal (a faust service ended by itself): "
                "exit 1, for its supervisor to start it again"
            )
            raise SystemExit(1) from None
        raise
