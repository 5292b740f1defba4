"""Run the stream processor as a process: topics, health endpoint, watchdog, faust worker.

Beside faust's worker run a heartbeat on its event loop and a watchdog thread
(``streams.watchdog``) judging the worker's progress (``streams.liveness``): ``/healthz``
fails on a stall, and the process exits 4 when no progress follows within
``SPENDGATE_WORKER_EXIT_S`` or a stop outlasts ``SPENDGATE_WORKER_STOP_GRACE_S``.
``SIGUSR1`` logs the diagnostics (``streams.diagnose``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

from faust.worker import Worker

from spendgate.schemas.connections import check_connections
from spendgate.schemas.key_settings import announce
from spendgate.streams import diagnose
from spendgate.streams.app import build_app
from spendgate.streams.exceptions import KafkaWaitExpired
from spendgate.streams.health import WorkerHealth
from spendgate.streams.health_server import HealthServer
from spendgate.streams.liveness import Liveness
from spendgate.streams.policybook import read_policies
from spendgate.streams.settings import WorkerSettings
from spendgate.streams.topics import check_usage, describe_usage, ensure_topics
from spendgate.streams.watchdog import Watchdog

logger = logging.getLogger(__name__)

#: How often the event loop beats (``Liveness.beat``).
BEAT_S = 0.2


class _Worker(Worker):
    """faust's worker, with a stop bounded by the watchdog and SIGUSR1 as diagnostics.

    A stop asked by SIGTERM or SIGINT arms the watchdog's grace
    (``SPENDGATE_WORKER_STOP_GRACE_S``) from the signal handler Python runs in the main
    thread, so even a loop blocked in a call is ended in time; mode's own handlers, run on
    the loop, then stop the app as before (the event loop's wake-up descriptor still
    carries the signal to them).
    """

    def __init__(self, *args: Any, watchdog: Watchdog, grace_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watchdog = watchdog
        self._grace_s = grace_s

    def install_signal_handlers(self) -> None:
        super().install_signal_handlers()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop_asked)

    def _stop_asked(self, signum: int, frame: FrameType | None) -> None:
        self._watchdog.stopping(self._grace_s)

    def _on_sigusr1(self) -> None:
        logger.warning("%s", diagnose.report(self.app, self.loop, "SIGUSR1"))


#: faust's offset commit as the liveness names it: it flushes the producer first (every
#: changelog write acked), and a flush has no bound of its own.
COMMIT_WAIT = "faust's offset commit (its producer flush first)"


def _beat(loop: asyncio.AbstractEventLoop, liveness: Liveness, app: Any) -> None:
    """Note that the loop ran and whether faust's offset commit is under way, and again in
    ``BEAT_S`` (a callback, not a task: nothing for mode to gather at the stop)."""
    liveness.beat()
    consumer = getattr(app, "_consumer", None)
    commit = getattr(consumer, "_commit_fut", None)
    if commit is not None and not commit.done():
        liveness.waiting(COMMIT_WAIT)
    else:
        liveness.ended(COMMIT_WAIT)
    if not loop.is_closed():
        loop.call_later(BEAT_S, _beat, loop, liveness, app)


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
    liveness = Liveness(settings.worker_stall_s, settings.worker_exit_s)
    if settings.metrics_port:
        HealthServer(
            health, settings.metrics_port, settings.metrics_host, liveness=liveness
        ).start()
        logger.info(
            "metrics on http://%s:%s/metrics (and /healthz, /readyz)",
            settings.metrics_host,
            settings.metrics_port,
        )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    watchdog: Watchdog | None = None

    def bound_hit(exc: KafkaWaitExpired) -> None:
        if watchdog is not None:
            watchdog.first_dump(f"kafka wait bound: {exc}")

    app = build_app(
        settings,
        policies,
        usage.retention_ms,
        health=health,
        liveness=liveness,
        bound_hit=bound_hit,
    )
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    watchdog = Watchdog(liveness, lambda why: diagnose.report(app, loop, why))
    worker = _Worker(
        app,
        loop=loop,
        loglevel="INFO",
        override_logging=False,
        quiet=True,
        watchdog=watchdog,
        grace_s=settings.worker_stop_grace_s,
    )
    loop.call_soon(_beat, loop, liveness, app)
    liveness.beat()  # the set-up above is no stall; the loop beats from its first step on
    watchdog.start()
    execute(worker)


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
