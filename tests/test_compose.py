"""docker-compose.yml cannot run here; check it against the settings classes instead, and
run its Redis arguments on a real redis-server."""

from __future__ import annotations

import re
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from spendgate.admission.settings import AdmissionSettings
from spendgate.dashboard.settings import DashboardSettings
from spendgate.streams.settings import WorkerSettings
from tests.fixtures.admission import free_port

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"
COMPOSE_ENV = COMPOSE.parent / "scripts" / "compose-env"


def _ports(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of each published port, short or long form."""
    found = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            host_ip = port.get("host_ip", "")
            found.append((host_ip, int(port["published"]), int(port["target"])))
            continue
        parts = str(port).split(":")
        if len(parts) == 3:
            found.append((parts[0], int(parts[1]), int(parts[2])))
        else:  # "H:C" or "C" publish on every interface
            found.append(("", int(parts[0]), int(parts[-1])))
    return found


def _redis_options(command: list[str]) -> list[tuple[str, list[str]]]:
    """The Redis command line as (``--name``, its words) in order; ``--user`` repeats."""
    options: list[tuple[str, list[str]]] = []
    for word in command[1:]:
        if word.startswith("--"):
            options.append((word, []))
        else:
            options[-1][1].append(word)
    return options


def _substitute(text: str, values: dict[str, str]) -> str:
    """Compose's ``${NAME:?message}`` substitution (the only form the file uses)."""
    return re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: values[m.group(1)], text)


def _env_names(settings: type[Any]) -> set[str]:
    prefix = settings.model_config["env_prefix"]
    return {f"{prefix}{name}".upper() for name in settings.model_fields}


class TestCompose:
    def setup_method(self) -> None:
        # As compose runs it, with stand-in secrets (compose refuses to start without them).
        values = {"SPENDGATE_REDIS_PASSWORD": "PW", "SPENDGATE_SUBJECT_SECRET": "SECRET"}
        self.services = yaml.safe_load(_substitute(COMPOSE.read_text(), values))["services"]

    def test_has_every_service_with_a_health_check(self) -> None:
        assert set(self.services) == {"kafka", "redis", "worker", "admission", "dashboard"}
        for name, service in self.services.items():
            assert "healthcheck" in service, name

    def test_kafka_is_kraft_4x_and_redis_is_7(self) -> None:
        kafka = self.services["kafka"]
        assert kafka["image"].startswith("apache/kafka:4.")
        assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert self.services["redis"]["image"] == "redis:7"

    def test_every_published_port_is_on_loopback_and_matches_the_defaults(self) -> None:
        published = {name: _ports(service) for name, service in self.services.items()}
        for name, ports in published.items():
            for host_ip, host_port, container_port in ports:
                assert host_ip == "127.0.0.1", f"{name} publishes {host_port} on {host_ip!r}"
                assert host_port == container_port, name
        admission = AdmissionSettings.model_fields["admission_port"].default
        metrics = WorkerSettings.model_fields["metrics_port"].default
        dash = DashboardSettings.model_fields["dashboard_port"].default
        assert {name: [p[1] for p in ports] for name, ports in published.items()} == {
            "kafka": [9092],
            "redis": [6379],
            "worker": [metrics],
            "admission": [admission],
            "dashboard": [dash],
        }

    def test_kafka_serves_the_services_on_the_network_and_the_host_on_its_loopback(
        self,
    ) -> None:
        env = self.services["kafka"]["environment"]
        advertised = dict(a.split("://") for a in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
        assert advertised == {"INTERNAL": "kafka:19092", "HOST": "127.0.0.1:9092"}
        assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] == "INTERNAL"
        for name in ("worker", "admission", "dashboard"):
            bootstrap = self.services[name]["environment"]["SPENDGATE_KAFKA_BOOTSTRAP"]
            assert bootstrap == "kafka:19092", name

    def test_redis_turns_the_default_user_off_and_services_log_in(self) -> None:
        users = [words for name, words in _redis_options(self.services["redis"]["command"])
                 if name == "--user"]  # fmt: skip
        assert users == [["default", "off"], ["spendgate", "on", ">PW", "~*", "&*", "+@all"]]
        for name in ("worker", "admission", "dashboard"):
            url = urlsplit(self.services[name]["environment"]["SPENDGATE_REDIS_URL"])
            assert (url.username, url.password, url.hostname, url.port) == (
                "spendgate", "PW", "redis", 6379,
            ), name  # fmt: skip
        health = self.services["redis"]["healthcheck"]["test"]
        assert health == ["CMD", "redis-cli", "--user", "spendgate", "ping"]
        assert self.services["redis"]["environment"]["REDISCLI_AUTH"] == "PW"

    def test_no_secret_is_written_in_the_file(self) -> None:
        text = COMPOSE.read_text()
        for name in ("SPENDGATE_REDIS_PASSWORD", "SPENDGATE_SUBJECT_SECRET"):
            # Every use is a required substitution: compose stops when it is not set.
            uses = re.findall(rf"\$\{{{name}([^}}]*)\}}", text)
            assert uses and all(u.startswith(":?") for u in uses), (name, uses)
        for name in ("worker", "admission"):
            assert self.services[name]["environment"]["SPENDGATE_SUBJECT_SECRET"] == "SECRET"
        # The dashboard shows key ids and never makes one: it does not get the secret.
        assert "SPENDGATE_SUBJECT_SECRET" not in self.services["dashboard"]["environment"]

    def test_a_service_listening_beyond_loopback_says_why_it_may(self) -> None:
        for name, host_field in (
            ("admission", "SPENDGATE_ADMISSION_HOST"),
            ("dashboard", "SPENDGATE_DASHBOARD_HOST"),
        ):
            env = self.services[name]["environment"]
            assert env[host_field] == "0.0.0.0", name
            # Without this (or a tokens file) the service refuses to start on 0.0.0.0.
            assert env["SPENDGATE_ALLOW_UNAUTHENTICATED"] == "true", name

    def test_environment_names_are_settings_fields(self) -> None:
        for name, settings in (
            ("worker", WorkerSettings),
            ("admission", AdmissionSettings),
            ("dashboard", DashboardSettings),
        ):
            env = set(self.services[name]["environment"])
            unknown = env - _env_names(settings)
            assert not unknown, f"{name} sets {unknown}, which {settings.__name__} lacks"
            assert {"SPENDGATE_KAFKA_BOOTSTRAP", "SPENDGATE_REDIS_URL"} <= env

    def test_workers_wait_for_healthy_dependencies(self) -> None:
        for name in ("worker", "admission", "dashboard"):
            deps = self.services[name]["depends_on"]
            assert deps == {
                "kafka": {"condition": "service_healthy"},
                "redis": {"condition": "service_healthy"},
            }

    def test_redis_persists_every_second_and_never_evicts(self) -> None:
        flags = dict(_redis_options(self.services["redis"]["command"]))
        assert flags["--appendonly"] == ["yes"]
        assert flags["--appendfsync"] == ["everysec"]
        assert flags["--maxmemory-policy"] == ["noeviction"]
        assert self.services["redis"]["volumes"]


def _compose_env(where: Path) -> dict[str, str]:
    """Run ``scripts/compose-env`` into ``where`` (under a lax umask) and read its ``.env``."""
    done = subprocess.run(["bash", "-c", f"umask 022; exec bash {COMPOSE_ENV} {where}"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = (where / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


class TestComposeEnv:
    def test_writes_two_fresh_private_secrets_once(self, tmp_path: Path) -> None:
        (tmp_path / "a").mkdir()
        first = _compose_env(tmp_path / "a")
        assert set(first) == {"SPENDGATE_REDIS_PASSWORD", "SPENDGATE_SUBJECT_SECRET"}
        for value in first.values():
            assert re.fullmatch(r"[0-9a-f]{64}", value), value  # 256 bits, URL-safe
        assert len(set(first.values())) == 2
        assert stat.S_IMODE((tmp_path / "a" / ".env").stat().st_mode) == 0o600
        (tmp_path / "b").mkdir()
        assert _compose_env(tmp_path / "b") != first
        # The URL compose builds from it carries the password intact.
        services = yaml.safe_load(_substitute(COMPOSE.read_text(), first))["services"]
        url = urlsplit(services["worker"]["environment"]["SPENDGATE_REDIS_URL"])
        assert url.password == first["SPENDGATE_REDIS_PASSWORD"]

    def test_never_overwrites_an_existing_env_file(self, tmp_path: Path) -> None:
        (tmp_path / ".env").write_text("SPENDGATE_SUBJECT_SECRET=keep-me\n")
        done = subprocess.run(["bash", str(COMPOSE_ENV), str(tmp_path)],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        assert done.returncode == 1
        assert "exists; keeping it" in done.stderr
        assert (tmp_path / ".env").read_text() == "SPENDGATE_SUBJECT_SECRET=keep-me\n"

    def test_git_ignores_the_env_file(self) -> None:
        assert ".env" in (COMPOSE.parent / ".gitignore").read_text().splitlines()


class TestRedisLogin:
    """The compose file's Redis arguments, run by a real redis-server on a spare port."""

    @pytest.fixture
    def server(self, tmp_path: Path) -> Iterator[tuple[int, str]]:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (scripts/setup installs it)"
        values = _compose_env(tmp_path)  # the secrets an operator's compose would get
        password = values["SPENDGATE_REDIS_PASSWORD"]
        text = _substitute(COMPOSE.read_text(), values)
        args = yaml.safe_load(text)["services"]["redis"]["command"]
        port = free_port()
        args = [binary, *args[1:], "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(tmp_path), "--appendonly", "no"]  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    assert proc.poll() is None, "redis-server refused the compose arguments"
                    assert time.monotonic() < deadline, "redis-server did not listen"
                    time.sleep(0.05)
            yield port, password
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    def test_only_the_spendgate_user_with_its_password_gets_in(
        self, server: tuple[int, str]
    ) -> None:
        port, password = server
        once = Retry(NoBackoff(), 0)
        # Without a login, nothing: not even PING.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"PING\r\n")
            assert raw.recv(100).startswith(b"-NOAUTH"), "Redis answered without a login"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password=password, retry=once).ping()  # the default user
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="spendgate", password=password + "x", retry=once).ping()
        client = redis.Redis.from_url(f"redis://spendgate:{password}@127.0.0.1:{port}/0")
        assert client.ping()
        # What the services run: plain keys, scripts loaded and called by SHA.
        assert client.set("sg:probe", "1") and client.get("sg:probe") == b"1"
        sha = client.script_load("return redis.call('INCR', KEYS[1])")
        assert client.evalsha(sha, 1, "sg:probe") == 2
        assert client.eval("return redis.call('GET', KEYS[1])", 1, "sg:probe") == b"2"


class TestImage:
    def test_the_image_copies_every_package_the_build_installs(self) -> None:
        import tomllib

        root = COMPOSE.parent
        folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-dir"
        ].values()
        dockerfile = (root / "Dockerfile").read_text().splitlines()
        for folder in folders:
            assert f"COPY {folder} {folder}" in dockerfile, folder
