"""A worker's ``/readyz`` on the real stack: a worker the group gives no partition is ready.

Real ``spendgate worker`` processes on one usage partition (the keyed topic has one too,
copartitioned): the second worker to join finds the first holding everything, and faust's
assignor moves nothing to it. It has joined and owns nothing to vouch for, so it answers
200 (a rollout gated on readiness would otherwise wait for a rebalance that may never
come; a CI soak once waited 90 s on such a worker).

Through the rebalance the second worker's join causes, the first worker's ``/healthz``
answers 200 (issue 52: a rebalance is no stall; its ``/readyz`` may answer 503 meanwhile).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import free_port
from tests.fixtures.pipeline import Workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MARKS = ["keyed:0", "usage:0"]
#: The first worker's stall bound far below a rebalance's few seconds.
TIGHT = {
    "SPENDGATE_WORKER_KAFKA_WAIT_S": "1",
    "SPENDGATE_WORKER_STALL_S": "1.5",
    "SPENDGATE_WORKER_EXIT_S": "120",
}


async def _readyz(port: int) -> tuple[int, dict[str, Any]] | None:
    async with httpx.AsyncClient(timeout=2) as http:
        try:
            answer = await http.get(f"http://127.0.0.1:{port}/readyz")
            return answer.status_code, answer.json()
        except (httpx.HTTPError, ValueError):
            return None


async def _until(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await check()
        if last is not None and last[0]:
            return last[1]
        await asyncio.sleep(0.3)
    raise AssertionError(f"{what} within {timeout_s}s; last: {last}")


async def _probe_healthz(port: int, into: list[int]) -> None:
    """``/healthz`` of the worker on ``port`` every 0.2 s into ``into`` (0: no answer)."""
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            try:
                into.append((await http.get(f"http://127.0.0.1:{port}/healthz")).status_code)
            except httpx.HTTPError:
                into.append(0)
            await asyncio.sleep(0.2)


@pytest.fixture
def one_partition(worker_settings: WorkerSettings, tmp_path: Path) -> Workers:
    """Workers on this test's topics, created with one partition each."""
    return Workers(worker_settings.model_copy(update={"partitions": 1}), tmp_path)


async def test_a_worker_given_no_partition_is_ready(one_partition: Workers, tmp_path: Path) -> None:
    workers = one_partition
    ports = {"w1": free_port(), "w2": free_port()}
    try:
        workers.start("w1", tmp_path / "data-w1", ports["w1"], env=TIGHT)

        async def first_ready() -> tuple[bool, Any] | None:
            got = await _readyz(ports["w1"])
            return None if got is None else (got[0] == 200, got[1])

        first = await _until(first_ready, 90, "the first worker was not ready")
        assert sorted(p["field"] for p in first["partitions"]) == MARKS
        workers.start("w2", tmp_path / "data-w2", ports["w2"])
        probes: list[int] = []
        probing = asyncio.create_task(_probe_healthz(ports["w1"], probes))

        async def both_joined() -> tuple[bool, Any] | None:
            got = [await _readyz(port) for port in ports.values()]
            if any(g is None for g in got):
                return None
            bodies = [g[1] for g in got if g is not None]
            generations = {b["generation"] for b in bodies}
            joined = len(generations) == 1 and generations != {first["generation"]}
            return joined and all(g is not None and g[0] == 200 for g in got), got

        got = await _until(both_joined, 120, "both workers were not ready on one generation")
        probing.cancel()
        assert probes and set(probes) == {200}, f"w1's /healthz through the rebalance: {probes}"
        owned = sorted(sorted(p["field"] for p in body["partitions"]) for _, body in got)
        # One owns both marks, the other nothing; both have their assignment and are ready.
        assert owned == [[], MARKS], owned
        assert all(body["assigned"] and body["ready"] for _, body in got), got
    finally:
        workers.stop_all()
