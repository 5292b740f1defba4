"""The local stack refuses ports it does not own and never signals strangers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from schemas.exceptions import ConfigurationError
from spendgate.devstack import LocalStack, StackSettings


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
