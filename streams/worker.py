"""Run the stream processor as a process: topics, metrics endpoint, faust worker."""

from __future__ import annotations

import asyncio
import logging

from faust.worker import Worker
from prometheus_client import start_http_server

from streams.app import build_app
from streams.policybook import read_policies
from streams.settings import WorkerSettings
from streams.topics import ensure_topics

logger = logging.getLogger(__name__)


def run_worker(settings: WorkerSettings) -> None:
    """Create missing topics, serve ``/metrics``, and run the faust worker until stopped."""
    asyncio.run(ensure_topics(settings))
    policies = asyncio.run(read_policies(settings.kafka_bootstrap, settings.topic("policies")))
    logger.info("%d policies in force at start", len(policies))
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="127.0.0.1")
        logger.info("metrics on http://127.0.0.1:%s/metrics", settings.metrics_port)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = build_app(settings, policies)
    worker = Worker(app, loglevel="INFO", override_logging=False, quiet=True)
    worker.execute_from_commandline()
