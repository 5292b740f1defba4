"""The worker process exits 1 when it stopped without a signal (``streams.worker.execute``),
so a supervisor that restarts only on failure starts it again."""

from __future__ import annotations

import logging

import pytest

from spendgate.streams.worker import execute


class ModeWorker:
    """mode's worker as ``execute`` sees it: it exits 0 whichever way it stopped."""

    def __init__(self, signalled: bool, code: int = 0) -> None:
        self._signal_stop_time = 12.5 if signalled else None
        self.code = code

    def execute_from_commandline(self) -> None:
        raise SystemExit(self.code)


def test_a_stop_no_signal_asked_for_exits_1(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as done:
        execute(ModeWorker(signalled=False))
    assert done.value.code == 1
    assert "stopped without a signal" in caplog.text


def test_a_signalled_stop_exits_0() -> None:
    with pytest.raises(SystemExit) as done:
        execute(ModeWorker(signalled=True))
    assert done.value.code == 0


def test_a_failure_keeps_its_code() -> None:
    with pytest.raises(SystemExit) as done:
        execute(ModeWorker(signalled=False, code=3))
    assert done.value.code == 3
