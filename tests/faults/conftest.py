"""Fixtures of the fault and abuse suite: figure records, admission processes, ledgers.

Every test records what it injected and what it observed through ``fault_record``; the
records land as JSON files in ``SPENDGATE_FAULTS_RESULTS`` (set by
``python -m tests.faults.report``), or in a session temp folder when unset, and
``tests/faults/report.py`` renders them into ``REPORT.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from spendgate.schemas import window_codec
from spendgate.schemas.policies import Policy
from spendgate.streams.materialize import RedisMaterializer
from tests.fixtures.admission import TOPOLOGY, VOUCHED, free_port
from tests.fixtures.services import Services

RESULTS_ENV = "SPENDGATE_FAULTS_RESULTS"


@dataclass
class FaultRecord:
    """What one test injected and observed; written as JSON when the test ends."""

    scenario: str
    test: str
    faults: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fault(self, text: str) -> None:
        """Note one fault as it is injected."""
        self.faults.append(text)

    def add(self, **figures: Any) -> None:
        """Set observed figures (later values replace earlier ones)."""
        self.figures.update(figures)

    def bump(self, name: str, by: int = 1) -> None:
        """Add to a counting figure."""
        self.figures[name] = self.figures.get(name, 0) + by


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the figure records go (``SPENDGATE_FAULTS_RESULTS`` or a temp folder)."""
    env = os.environ.get(RESULTS_ENV)
    path = Path(env) if env else tmp_path_factory.mktemp("fault-results")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def fault_record(request: pytest.FixtureRequest, results_dir: Path) -> Iterator[FaultRecord]:
    """A record of this test's faults and figures, written even when the test fails."""
    scenario = str(getattr(request.module, "SCENARIO", "?"))
    record = FaultRecord(scenario=scenario, test=request.node.nodeid)
    started = time.monotonic()
    yield record
    record.figures.setdefault("seconds", round(time.monotonic() - started, 1))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)[-150:]
    (results_dir / f"{name}.json").write_text(json.dumps(record.__dict__, indent=2, default=str))


# --- ledgers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """Every window Redis holds under a prefix against the exact ledger, in units and in
    (key, bucket) cells.

    ``units_held`` is read from Redis (every window under the prefix, not only the
    ledger's keys), ``units_expected`` is the ledger's sum; ``keys_missing`` are ledger keys
    with usage that Redis has no usage for, ``keys_unexpected`` windows with usage that the
    ledger has none for (a window written under a wrong key).
    """

    keys: int
    cells: int
    units_expected: int
    units_held: int
    units_lost: int
    units_double_counted: int
    cells_differing: int
    keys_missing: tuple[str, ...] = ()
    keys_unexpected: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        """Whether Redis holds exactly the ledger's keys, bucket for bucket."""
        return self.cells_differing == 0 and not self.keys_missing and not self.keys_unexpected


def read_buckets(client: redis.Redis, prefix: str, key: str) -> dict[int, int]:
    """The materialized buckets of ``key`` ({} when absent)."""
    raw = client.get(f"{prefix}w:{key}")
    return dict(window_codec.decode(raw).buckets) if isinstance(raw, bytes) else {}


def compare(
    client: redis.Redis,
    prefix: str,
    expected: dict[str, dict[int, int]],
    *,
    checked_apart: Collection[str] = (),
) -> Comparison:
    """Compare every window under ``prefix`` in Redis with the ledger ``expected``.

    Windows of keys in ``checked_apart`` (which the test checks by other means, e.g. a key
    whose buckets depend on the server clock) are left out; every other window counts,
    so usage written under a key the ledger does not have is a difference.
    """
    held = {k: b for k, b in all_windows(client, prefix).items() if k not in checked_apart}
    lost = double = differing = cells = 0
    for key in set(expected) | set(held):
        want, have = expected.get(key, {}), held.get(key, {})
        for bucket in set(want) | set(have):
            cells += 1
            w, h = want.get(bucket, 0), have.get(bucket, 0)
            if w != h:
                differing += 1
                lost += max(0, w - h)
                double += max(0, h - w)
    want_keys = {k for k, b in expected.items() if any(b.values())}
    have_keys = {k for k, b in held.items() if any(b.values())}
    return Comparison(
        keys=len(expected),
        cells=cells,
        units_expected=sum(sum(b.values()) for b in expected.values()),
        units_held=sum(sum(b.values()) for b in held.values()),
        units_lost=lost,
        units_double_counted=double,
        cells_differing=differing,
        keys_missing=tuple(sorted(want_keys - have_keys)),
        keys_unexpected=tuple(sorted(have_keys - want_keys)),
    )


def all_windows(client: redis.Redis, prefix: str) -> dict[str, dict[int, int]]:
    """Every window under ``prefix``: budget key -> buckets."""
    out = {}
    for raw in client.scan_iter(match=f"{prefix}w:*", count=1000):
        name = raw.decode()
        out[name.removeprefix(f"{prefix}w:")] = read_buckets(
            client, prefix, name.removeprefix(f"{prefix}w:")
        )
    return out


def snapshot(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` with its type-specific value (to prove nothing changed)."""
    out: dict[str, Any] = {}
    for raw in client.scan_iter(match=f"{prefix}*", count=1000):
        kind = client.type(raw)
        name = raw.decode()
        if kind == b"string":
            out[name] = client.get(raw)
        elif kind == b"hash":
            out[name] = client.hgetall(raw)
        elif kind == b"zset":
            out[name] = ("zset", client.zrange(raw, 0, -1, withscores=True))
        elif kind == b"set":
            out[name] = ("set", sorted(client.smembers(raw)))
        elif kind == b"list":
            out[name] = ("list", client.lrange(raw, 0, -1))
        else:
            # Any other type by its serialized value (streams, modules' types).
            out[name] = (kind, client.dump(raw))
    return out


async def write_policies(redis_url: str, prefix: str, *policies: Policy) -> None:
    """Materialize policies into Redis as the worker does (admission-only scenarios)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await RedisMaterializer(client, prefix).stand_in(policies, TOPOLOGY, VOUCHED)
    finally:
        await client.aclose()


# --- real admission processes ------------------------------------------------------------


@dataclass
class AdmissionProc:
    """One ``spendgate admission`` process."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


class AdmissionProcs:
    """Starts real ``spendgate admission`` processes (uvicorn) and stops them all."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[AdmissionProc] = []

    def start(
        self,
        *,
        kafka_bootstrap: str,
        redis_url: str,
        topic_prefix: str,
        redis_prefix: str,
        name: str = "a1",
        extra_env: dict[str, str] | None = None,
    ) -> AdmissionProc:
        port = free_port()
        env = {
            **os.environ,
            "SPENDGATE_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "SPENDGATE_REDIS_URL": redis_url,
            "SPENDGATE_TOPIC_PREFIX": topic_prefix,
            "SPENDGATE_REDIS_PREFIX": redis_prefix,
            "SPENDGATE_ADMISSION_HOST": "127.0.0.1",
            "SPENDGATE_ADMISSION_PORT": str(port),
            "SPENDGATE_POLICY_REFRESH_S": "0.1",
            # The machine is shared and small (2 cores): a slow Redis answer is not an
            # outage here, and these tests assert exact status sets. Outages are injected
            # by stopping redis-server, which refuses connections at once.
            "SPENDGATE_REDIS_TIMEOUT_S": "10.0",
            **(extra_env or {}),
        }
        log = self.logs / f"admission-{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "spendgate", "admission"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        handle = AdmissionProc(name, f"http://127.0.0.1:{port}", proc, log)
        self.started.append(handle)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"admission {name} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{handle.url}/healthz", timeout=1).status_code == 200:
                    return handle
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"admission {name} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop_all(self) -> None:
        for handle in self.started:
            if handle.proc.poll() is None:
                handle.proc.terminate()
        for handle in self.started:
            try:
                handle.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                handle.proc.kill()
                handle.proc.wait()


@pytest.fixture
def admission_procs(tmp_path: Path) -> Iterator[AdmissionProcs]:
    """A factory of real admission processes, all stopped after the test."""
    procs = AdmissionProcs(tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture
def redis_url(services: Services) -> str:
    """The shared Redis (tests use their own key prefix and never flush it)."""
    return services.redis_url


async def gather_bounded(coros: list[Any], limit: int) -> list[Any]:
    """Run coroutines concurrently, at most ``limit`` at a time, keeping the order."""
    gate = asyncio.Semaphore(limit)

    async def one(coro: Any) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros))


async def read_topic(
    bootstrap: str, topic: str, at_least: int = 1, timeout_s: float = 60.0
) -> list[bytes]:
    """Every value of ``topic``, re-read until there are ``at_least`` (or time is up).

    One read can come back empty on a loaded shared broker (fresh metadata without the
    topic yet); the longest read seen is returned.
    """
    from tests.fixtures.kafka_io import read_all

    best: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while True:
        values = await read_all(bootstrap, topic)
        if len(values) > len(best):
            best = values
        if len(best) >= at_least or time.monotonic() > deadline:
            return best
        await asyncio.sleep(0.5)
