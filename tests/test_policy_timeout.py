"""``spendgate policy apply`` and ``policy delete`` against a broker that accepts connections
and never answers: each exits 3 within ``SPENDGATE_POLICY_TIMEOUT_S`` with one ``error:``
line naming what to check; a bound of 0 or less is refused before anything is reached."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spendgate.streams.policy_admin import POLICY_TIMEOUT_S, STOP_S
from tests.fixtures.blackhole import running

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ROOT / "examples" / "policies.yaml"
#: SPENDGATE_POLICY_TIMEOUT_S of these runs.
TIMEOUT_S = 1.5
#: What starting a Python process and importing spendgate takes, on a loaded CI box.
SLACK_S = 3.0


def _spendgate(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "spendgate", *args],
        env={**os.environ, "SPENDGATE_TOPIC_PREFIX": "blackhole.", **env},
        capture_output=True,
        text=True,
        # Far past the bound: a command that hangs fails here instead of hanging the run.
        timeout=POLICY_TIMEOUT_S + 60,
        check=False,
    )
    return done, time.monotonic() - started


@pytest.mark.parametrize(
    ("reads", "command"),
    [(True, ["apply", str(POLICIES)]), (True, ["delete", "p1"]), (False, ["apply", str(POLICIES)])],
    ids=["apply-silent", "delete-silent", "apply-deaf"],
)
def test_a_policy_command_gives_up_on_a_silent_broker_within_its_bound(
    reads: bool, command: list[str]
) -> None:
    with running(reads=reads) as hole:
        done, took = _spendgate(
            "policy",
            *command,
            SPENDGATE_KAFKA_BOOTSTRAP=hole.bootstrap,
            SPENDGATE_POLICY_TIMEOUT_S=str(TIMEOUT_S),
        )
        assert hole.accepted >= 1  # it reached the broker, which never answered
    print(f"policy {command[0]}: exit {done.returncode} after {took:.2f} s")
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 3, output
    assert TIMEOUT_S <= took < TIMEOUT_S + STOP_S + SLACK_S
    (line,) = output.splitlines()  # one line: no traceback, no unclosed-client noise
    assert line.startswith(f"error: policy {command[0]}: Kafka at {hole.bootstrap} did not answer")
    assert f"SPENDGATE_POLICY_TIMEOUT_S={TIMEOUT_S:g}" in line
    assert "check SPENDGATE_KAFKA_BOOTSTRAP" in line
    assert line.endswith("nothing was written")


@pytest.mark.parametrize("bound", ["0", "-1"])
def test_a_bound_of_zero_or_less_is_refused_at_start(bound: str) -> None:
    done, _ = _spendgate(
        "policy", "delete", "p1", SPENDGATE_KAFKA_BOOTSTRAP="127.0.0.1:1",
        SPENDGATE_POLICY_TIMEOUT_S=bound,
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        done.stderr.strip() == "error: SPENDGATE_POLICY_TIMEOUT_S: Input should be greater than 0"
    )
