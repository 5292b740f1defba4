"""The local stack refuses ports it does not own and never signals strangers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from spendgate.devstack import LocalStack, StackSettings
from spendgate.schemas.exceptions import ConfigurationError


class TestLocalStack:
    def test_a_port_taken_by_another_process_is_refused(self, tmp_path: Path) -> None:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            stack = LocalStack(StackSettings(redis_port=port, stack_dir=tmp_path))
            with pytest.raises(ConfigurationError, match=f"port {port}"):
                stack._start_redis()

    def test_down_without_recorded_pids_stops_nothing(self, tmp_path: Path) -> None:
        stack = LocalStack(StackSettings(stack_dir=tmp_path))
        assert stack.down() == []

    def test_a_stale_pidfile_is_ignored(self, tmp_path: Path) -> None:
        stack = LocalStack(StackSettings(stack_dir=tmp_path))
        (tmp_path / "redis.pid").write_text("999999999")
        assert stack.pid("redis") is None

    def test_redis_persists_every_second_and_never_evicts(self, tmp_path: Path) -> None:
        command = LocalStack(StackSettings(stack_dir=tmp_path)).redis_command()
        flags = dict(zip(command[1::2], command[2::2], strict=True))
        assert flags["--appendonly"] == "yes"
        assert flags["--appendfsync"] == "everysec"
        assert flags["--maxmemory-policy"] == "noeviction"
        assert flags["--dir"] == str(tmp_path / "redis")

    def test_wipe_also_deletes_the_redis_append_only_file(self, tmp_path: Path) -> None:
        (tmp_path / "redis" / "appendonlydir").mkdir(parents=True)
        (tmp_path / "kafka" / "data").mkdir(parents=True)
        LocalStack(StackSettings(stack_dir=tmp_path)).wipe()
        assert not (tmp_path / "redis").exists() and not (tmp_path / "kafka" / "data").exists()
