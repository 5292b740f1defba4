"""Admission and the dashboard listen beyond loopback only with auth, or when told to."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from spendgate.admission.auth import check_exposure, is_loopback, load_tokens
from spendgate.admission.settings import AdmissionSettings
from spendgate.dashboard.settings import DashboardSettings
from spendgate.schemas.exceptions import ConfigurationError

#: Nothing listens here (a service that serves must not need Kafka or Redis to start).
CLOSED = {
    "SPENDGATE_KAFKA_BOOTSTRAP": "127.0.0.1:9",
    "SPENDGATE_REDIS_URL": "redis://127.0.0.1:9/0",
}


@dataclass
class Held:
    """Sockets the test listens on in place of everything a refused service could reach
    (Kafka, Redis, the metrics it scrapes), and the port it would serve on, held by the
    test on loopback so that listening there (on any address) fails."""

    upstreams: dict[str, socket.socket]
    port: socket.socket

    def env(self) -> dict[str, str]:
        at = {name: f"127.0.0.1:{s.getsockname()[1]}" for name, s in self.upstreams.items()}
        port = str(self.port.getsockname()[1])
        return {
            "SPENDGATE_KAFKA_BOOTSTRAP": at["kafka"],
            "SPENDGATE_REDIS_URL": f"redis://{at['redis']}/0",
            "SPENDGATE_ADMISSION_METRICS_URL": f"http://{at['admission metrics']}/metrics",
            "SPENDGATE_WORKER_METRICS_URL": f"http://{at['worker metrics']}/metrics",
            "SPENDGATE_ADMISSION_PORT": port,
            "SPENDGATE_DASHBOARD_PORT": port,
        }

    def connections(self) -> dict[str, int]:
        """How many connections reached each socket: the kernel completes a handshake
        and queues it whether or not anyone accepts, so one tried by a process that has
        exited since is still counted here."""
        counts = {}
        for name, s in self.upstreams.items():
            counts[name] = 0
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                conn.close()
                counts[name] += 1
        return counts


@pytest.fixture
def held() -> Iterator[Held]:
    sockets = []
    try:
        for _ in range(5):
            s = socket.socket()
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            s.setblocking(False)
        *ups, port = sockets
        names = ("kafka", "redis", "admission metrics", "worker metrics")
        yield Held(dict(zip(names, ups, strict=True)), port)
    finally:
        for s in sockets:
            s.close()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.20", False),
        ("10.0.0.1", False),
        ("example.internal", False),
        ("", False),
    ],
)
def test_which_addresses_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_check_allows_loopback_a_tokens_file_or_an_explicit_yes(tmp_path: Path) -> None:
    check_exposure("admission", "127.0.0.1", 8787, None, False)
    check_exposure("admission", "0.0.0.0", 8787, tmp_path / "tokens.yaml", False)
    check_exposure("admission", "0.0.0.0", 8787, None, True)
    with pytest.raises(ConfigurationError) as caught:
        check_exposure("dashboard", "0.0.0.0", 8788, None, False)
    message = str(caught.value)
    assert "\n" not in message
    assert "0.0.0.0:8788" in message and "SPENDGATE_AUTH_TOKENS_FILE" in message
    assert "--allow-unauthenticated" in message


def _run(held: Held, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``spendgate *args`` to its end, everything it could reach held by the test, and
    assert it connected to none of it before it was refused (nor listened: the port is
    taken, a bind would have failed with its own error)."""
    done = subprocess.run(
        [sys.executable, "-m", "spendgate", *args],
        env={**os.environ, **held.env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert held.connections() == dict.fromkeys(held.upstreams, 0), done.stderr
    return done


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["admission", "--host", "0.0.0.0"], {}),
        (["admission"], {"SPENDGATE_ADMISSION_HOST": "0.0.0.0"}),
        (["admission", "--workers", "2", "--host", "0.0.0.0"], {}),
        (["dashboard", "--host", "0.0.0.0"], {}),
        (["dashboard"], {"SPENDGATE_DASHBOARD_HOST": "::"}),
    ],
)
def test_a_non_loopback_bind_without_auth_is_refused_in_one_line(
    held: Held, args: list[str], env: dict[str, str]
) -> None:
    done = _run(held, args, **env)
    assert done.returncode == 2, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "refusing to listen on" in lines[0] and "without auth" in lines[0]
    assert "Traceback" not in done.stderr


def test_allow_unauthenticated_serves_beyond_loopback() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spendgate",
            "dashboard",
            "--host",
            "0.0.0.0",
            "--allow-unauthenticated",
        ],
        env={**os.environ, **CLOSED, "SPENDGATE_DASHBOARD_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        answered = None
        while time.monotonic() < deadline and proc.poll() is None and answered is None:
            try:
                answered = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code
            except httpx.HTTPError:
                time.sleep(0.2)
        assert answered == 200, proc.stderr.read() if proc.poll() is not None else "no answer"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.mark.parametrize(
    "settings", [AdmissionSettings, DashboardSettings], ids=lambda s: s.__name__
)
@pytest.mark.parametrize(("raw", "means"), [("true", True), ("TRUE", True), ("false", False),
                                            ("yes", None), ("1", None), ("on", None)])  # fmt: skip
def test_the_switch_takes_only_true_or_false(
    settings: type[AdmissionSettings | DashboardSettings],
    raw: str,
    means: bool | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPENDGATE_ALLOW_UNAUTHENTICATED", raw)
    if means is None:  # a guess at a security switch is an error, not a yes
        with pytest.raises(ValidationError, match="allow_unauthenticated"):
            settings()
    else:
        assert settings().allow_unauthenticated is means


#: Modes a secret file may have: the owner's, and its group's read (a Kubernetes Secret volume
#: with ``defaultMode: 0440`` and an ``fsGroup``).
PRIVATE_MODES = [0o600, 0o400, 0o640, 0o440]
#: Modes that share it: others read or write it, or its group writes it.
SHARED_MODES = [0o644, 0o666, 0o604, 0o602, 0o620, 0o660]


class TestTokensFileMode:
    def _write(self, path: Path, mode: int) -> Path:
        path.write_text("very-secret-token: [acme]\n")
        path.chmod(mode)
        return path

    @pytest.mark.parametrize("mode", SHARED_MODES, ids=oct)
    def test_a_file_others_can_access_is_refused(self, tmp_path: Path, mode: int) -> None:
        path = self._write(tmp_path / "tokens.yaml", mode)
        with pytest.raises(ConfigurationError) as caught:
            load_tokens(path)
        message = str(caught.value)
        assert "\n" not in message
        assert f"chmod 600 {path}" in message and "defaultMode: 0440" in message
        assert "very-secret-token" not in message

    @pytest.mark.parametrize("mode", PRIVATE_MODES, ids=oct)
    def test_an_owner_or_group_readable_file_is_read(self, tmp_path: Path, mode: int) -> None:
        path = self._write(tmp_path / "tokens.yaml", mode)
        assert load_tokens(path) == {"very-secret-token": frozenset({"acme"})}

    @pytest.mark.parametrize("mode", [0o644, 0o666], ids=oct)
    def test_the_service_refuses_it_at_start(self, held: Held, tmp_path: Path, mode: int) -> None:
        path = self._write(tmp_path / "tokens.yaml", mode)
        done = _run(held, ["admission"], SPENDGATE_AUTH_TOKENS_FILE=str(path))
        assert done.returncode == 2
        lines = [line for line in done.stderr.splitlines() if str(path) in line]
        assert len(lines) == 1 and f"chmod 600 {path}" in lines[0], done.stderr
        assert "very-secret-token" not in done.stdout + done.stderr

    @pytest.mark.parametrize("mode", [0o440, 0o640], ids=oct)
    def test_the_service_starts_with_group_readable_secret_files(
        self, tmp_path: Path, mode: int
    ) -> None:
        # As a Kubernetes Secret volume mounts them: the tokens file and the subject secret
        # file, group-readable; admission answers, and auth is on, from the file.
        tokens = self._write(tmp_path / "tokens.yaml", mode)
        secret = tmp_path / "subject-secret"
        secret.write_text("a-subject-secret-of-32-bytes-ok!\n")
        secret.chmod(mode)
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "SPENDGATE_SUBJECT_SECRET"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "spendgate", "admission"],
            env={
                **env,
                **CLOSED,
                "SPENDGATE_AUTH_TOKENS_FILE": str(tokens),
                "SPENDGATE_SUBJECT_SECRET_FILE": str(secret),
                "SPENDGATE_ADMISSION_PORT": str(port),
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            answered = None
            while time.monotonic() < deadline and proc.poll() is None and answered is None:
                try:
                    answered = httpx.get(f"{base}/healthz", timeout=1).status_code
                except httpx.HTTPError:
                    time.sleep(0.2)
            assert answered == 200, proc.stderr.read() if proc.poll() is not None else "no answer"
            assert httpx.post(f"{base}/v1/admit", json={}, timeout=5).status_code == 401
            with_token = httpx.post(
                f"{base}/v1/admit",
                json={},
                headers={"Authorization": "Bearer very-secret-token"},
                timeout=5,
            )
            assert with_token.status_code not in (401, 403), with_token.text
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            assert proc.stderr is not None
            proc.stderr.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class TestDashboardSessionSecret:
    def _tokens(self, tmp_path: Path) -> Path:
        path = tmp_path / "tokens.yaml"
        path.write_text("very-secret-token: [acme]\n")
        return path

    def test_beyond_loopback_with_auth_it_is_required(self, held: Held, tmp_path: Path) -> None:
        tokens = self._tokens(tmp_path)
        done = _run(
            held, ["dashboard", "--host", "0.0.0.0"], SPENDGATE_AUTH_TOKENS_FILE=str(tokens)
        )
        assert done.returncode == 2
        lines = [line for line in done.stderr.splitlines() if "SESSION_SECRET" in line]
        assert len(lines) == 1 and "SPENDGATE_DASHBOARD_SESSION_SECRET_FILE" in lines[0]

    def test_a_short_one_is_refused(self, held: Held, tmp_path: Path) -> None:
        tokens = self._tokens(tmp_path)
        done = _run(
            held,
            ["dashboard"],
            SPENDGATE_AUTH_TOKENS_FILE=str(tokens),
            SPENDGATE_DASHBOARD_SESSION_SECRET="short",
        )
        assert done.returncode == 2
        assert "at least 16 bytes" in done.stderr and "short" not in done.stderr
