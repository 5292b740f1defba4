"""Admission warns at startup when Redis would not keep its writes (persistence, eviction)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from spendgate.admission.redis_check import durability_problems, warn_if_not_durable
from spendgate.devstack import LocalStack, StackSettings
from tests.fixtures.admission import REDIS_SERVER, free_port
from tests.fixtures.services import _unavailable


@contextmanager
def redis_server(args: list[str]) -> Iterator[aioredis.Redis]:
    """A private redis-server started with ``args`` (port and bind are added)."""
    if not Path(REDIS_SERVER).exists() and shutil.which("redis-server") is None:
        _unavailable("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen(
        [*args, "--port", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        probe = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        probe.close()
        yield aioredis.Redis(port=port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class TestDurabilityProblems:
    def test_a_durable_configuration_has_none(self) -> None:
        config = {"appendonly": "yes", "appendfsync": "everysec", "save": "",
                  "maxmemory-policy": "noeviction"}  # fmt: skip
        assert durability_problems(config) == []

    def test_each_problem_is_named(self) -> None:
        found = durability_problems({"appendonly": "no", "save": "3600 1",
                                     "maxmemory-policy": "allkeys-lru"})  # fmt: skip
        assert len(found) == 2
        assert "appendonly is off (RDB snapshots only)" in found[0]
        assert "'allkeys-lru'" in found[1]
        assert (
            "appendfsync is 'no'"
            in durability_problems({"appendonly": "yes", "appendfsync": "no"})[0]
        )


@pytest.mark.integration
class TestStartupWarning:
    async def test_the_dev_stack_redis_passes(self, tmp_path: Path) -> None:
        stack = LocalStack(StackSettings(stack_dir=tmp_path))
        (tmp_path / "redis").mkdir()
        (tmp_path / "logs").mkdir()
        binary = shutil.which("redis-server") or REDIS_SERVER
        args = stack.redis_command(binary)
        cut = args.index("--port")
        with redis_server(args[:cut] + args[cut + 4 :]) as client:
            assert await warn_if_not_durable(client) == []
            await client.aclose()

    async def test_a_volatile_redis_is_warned_about(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        args = [REDIS_SERVER, "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                "--maxmemory-policy", "volatile-lru"]  # fmt: skip
        caplog.set_level(logging.WARNING, logger="spendgate.admission.redis_check")
        with redis_server(args) as client:
            problems = await warn_if_not_durable(client)
            await client.aclose()
        assert len(problems) == 2
        warned = [r.getMessage() for r in caplog.records]
        assert any("no persistence at all" in w for w in warned)
        assert any("'volatile-lru'" in w for w in warned)

    async def test_config_disabled_is_tolerated(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        args = [REDIS_SERVER, "--save", "", "--dir", str(tmp_path),
                "--rename-command", "CONFIG", '""']  # fmt: skip
        caplog.set_level(logging.INFO, logger="spendgate.admission.redis_check")
        with redis_server(args) as client:
            assert await warn_if_not_durable(client) == []
            await client.aclose()
        assert any("CONFIG refused" in r.getMessage() for r in caplog.records)
