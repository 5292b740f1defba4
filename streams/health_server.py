"""The worker's own HTTP endpoint beside its event loop: metrics, liveness, readiness.

A stdlib ``ThreadingHTTPServer`` in a daemon thread (the faust event loop never serves
HTTP, so a busy fold never delays a probe, and a probe never holds up the fold):

- ``GET /metrics``: Prometheus text exposition (``prometheus_client.generate_latest``);
- ``GET /healthz``: 200 while the worker makes progress (``streams.liveness``: the event
  loop runs, and no agent holds records without progress for ``SPENDGATE_WORKER_STALL_S``),
  else 503 with the reason; an idle worker, or one retrying a failing store, is healthy;
- ``GET /readyz``: 200 when :meth:`streams.health.WorkerHealth.ready` (assigned, every
  owned partition vouched for, updated recently), else 503; the body is
  :meth:`~streams.health.WorkerHealth.snapshot` as JSON either way.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from spendgate.streams.health import WorkerHealth
from spendgate.streams.liveness import Liveness

logger = logging.getLogger(__name__)

__all__ = ["HealthServer"]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    health: WorkerHealth
    registry: CollectorRegistry
    liveness: Liveness | None


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            liveness = self.server.liveness
            if liveness is None:
                self._json(200, {"status": "ok"})
            else:
                verdict = liveness.verdict()
                self._json(200 if verdict.healthy else 503, verdict.body())
        elif path == "/readyz":
            health = self.server.health
            snapshot = health.snapshot()
            self._json(200 if snapshot["ready"] else 503, snapshot)
        else:
            self._json(404, {"error": {"code": "not_found", "message": f"no route {path}"}})

    def _json(self, status: int, body: object) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        # Probes come every few seconds: not worth a log line each.
        return


class HealthServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` of one worker in a daemon thread."""

    def __init__(
        self,
        health: WorkerHealth,
        port: int,
        host: str = "127.0.0.1",
        registry: CollectorRegistry = REGISTRY,
        liveness: Liveness | None = None,
    ) -> None:
        """Bind at once (``port`` 0: any free port, see :attr:`port`); serve on :meth:`start`.

        Raises:
            OSError: the port is taken.
        """
        self._server = _Server((host, port), _Handler)
        self._server.health = health
        self._server.registry = registry
        self._server.liveness = liveness
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port bound."""
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        """Serve in a daemon thread (it dies with the process)."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="worker-health", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()
