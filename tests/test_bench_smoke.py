"""Smoke runs of the benchmarks: each runs in its tiny ``--smoke`` mode and prints its
figures beside its baseline. Benchmarks are not tests: no performance target is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.services import Services

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


def _run(module: str, services: Services, timeout_s: float = 60.0) -> str:
    env = {
        **os.environ,
        "SPENDGATE_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
        "SPENDGATE_REDIS_URL": services.redis_url,
    }
    done = subprocess.run(
        [sys.executable, "-m", module, "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, f"{module} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


class TestBenchSmoke:
    def test_admission(self, services: Services) -> None:
        out = _run("bench.admission", services)
        assert "spendgate /v1/admit, 1 budget(s)" in out
        assert "baseline lua direct" in out
        assert "baseline empty endpoint" in out
        assert "targets:" in out

    def test_overshoot(self, services: Services) -> None:
        out = _run("bench.overshoot", services)
        assert "| exact    | 0     | spendgate " in out
        assert "fixed-window (baseline)" in out
        assert "units over the limit" in out

    def test_memory(self, services: Services) -> None:
        out = _run("bench.memory", services)
        assert "Redis MEMORY USAGE B" in out
        assert "baseline: empty window MEMORY USAGE B" in out
        assert "baseline: value without dedupe B" in out

    def test_processor(self, services: Services) -> None:
        out = _run("bench.processor", services, timeout_s=120.0)
        assert "spendgate worker (split + account + Redis)" in out
        assert "baseline: raw aiokafka consume" in out
        assert "spendgate: produced -> visible in Redis" in out
        assert "baseline: produced -> consumable (raw)" in out

    def test_replay(self, services: Services) -> None:
        out = _run("bench.replay", services)
        assert "spendgate replay()" in out
        assert "baseline: raw aiokafka consume" in out
