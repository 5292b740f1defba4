"""The Dockerfile's promises, checked without Docker (none here): two stages, a non-root
user, the services' ports exposed, one entrypoint for every role, the version label, and a
HEALTHCHECK whose command is run here against a real listener."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from spendgate.admission.settings import AdmissionSettings
from spendgate.dashboard.settings import DashboardSettings
from spendgate.streams.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
#: The uid and gid the image runs as (the Helm chart's runAsUser and fsGroup too).
UID = 10001


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse(text: str) -> list[list[Instruction]]:
    """The Dockerfile's instructions, one list per stage (continuations joined, comments
    dropped)."""
    stages: list[list[Instruction]] = []
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        keyword, _, args = logical.partition(" ")
        logical = ""
        if keyword.upper() == "FROM":
            stages.append([])
        assert stages, "an instruction before the first FROM"
        stages[-1].append(Instruction(keyword.upper(), args.strip()))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[list[Instruction]]:
    return parse((ROOT / "Dockerfile").read_text())


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, (keyword, found)
    return found[0]


class TestStages:
    def test_a_build_stage_and_a_runtime_stage_that_copies_only_the_virtualenv(
        self, stages: list[list[Instruction]]
    ) -> None:
        assert len(stages) == 2
        build, run = stages
        assert only(build, "FROM").args.endswith(" AS build")
        copies = [i.args for i in run if i.keyword == "COPY"]
        assert copies == ["--from=build /opt/spendgate /opt/spendgate"]

    def test_every_package_the_build_installs_is_copied_into_the_build_stage(
        self, stages: list[list[Instruction]]
    ) -> None:
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        folders = pyproject["tool"]["setuptools"]["package-dir"].values()
        copied = {i.args for i in stages[0] if i.keyword == "COPY"}
        assert {f"{f} {f}" for f in folders} <= copied


class TestRuntime:
    def test_it_runs_as_the_unprivileged_user_to_the_end(
        self, stages: list[list[Instruction]]
    ) -> None:
        run = stages[-1]
        user = only(run, "USER")
        assert user.args == f"{UID}:{UID}"
        made = " ".join(i.args for i in run if i.keyword == "RUN")
        assert f"--uid {UID}" in made and f"--gid {UID}" in made
        # Nothing runs as root after the switch.
        after = run[run.index(user) + 1 :]
        assert all(i.keyword not in {"RUN", "USER"} for i in after), after

    def test_the_worker_data_dir_is_the_users_volume(self, stages: list[list[Instruction]]) -> None:
        run = stages[-1]
        env = " ".join(i.args for i in run if i.keyword == "ENV")
        assert "SPENDGATE_DATA_DIR=/data/tables" in env
        made = " ".join(i.args for i in run if i.keyword == "RUN")
        assert f"chown {UID}:{UID} /data" in made
        assert "PYTHONDONTWRITEBYTECODE=1" in env  # nothing written beside the code

    def test_the_exposed_ports_are_the_services_defaults(
        self, stages: list[list[Instruction]]
    ) -> None:
        exposed = {int(p) for p in only(stages[-1], "EXPOSE").args.split()}
        defaults = {
            AdmissionSettings.model_fields["admission_port"].default,
            DashboardSettings.model_fields["dashboard_port"].default,
            WorkerSettings.model_fields["metrics_port"].default,
        }
        assert exposed == defaults

    def test_one_entrypoint_the_command_picks_the_role(
        self, stages: list[list[Instruction]]
    ) -> None:
        run = stages[-1]
        assert json.loads(only(run, "ENTRYPOINT").args) == ["spendgate"]
        assert json.loads(only(run, "CMD").args) == ["--help"]
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        assert "spendgate" in pyproject["project"]["scripts"]
        # Compose runs the same image: each service's command is a role, not a program.
        compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
        for name in ("worker", "admission", "dashboard"):
            assert compose[name]["command"][0] == name, compose[name]["command"]

    def test_the_version_label_is_the_packages(self, stages: list[list[Instruction]]) -> None:
        run = stages[-1]
        version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
        assert only(run, "ARG").args == f"VERSION={version}"
        label = only(run, "LABEL").args
        assert 'org.opencontainers.image.version="${VERSION}"' in label
        assert re.search(r'org\.opencontainers\.image\.licenses="Apache-2\.0"', label)


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def listener() -> Iterator[tuple[HTTPServer, type[_Health]]]:
    handler = type("Handler", (_Health,), {})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, handler
    finally:
        server.shutdown()
        server.server_close()


class TestHealthcheck:
    @staticmethod
    def run(stages: list[list[Instruction]], **env: str) -> int:
        check = only(stages[-1], "HEALTHCHECK").args
        options, _, command = check.partition("CMD ")
        assert "--interval=" in options and "--timeout=" in options
        argv = json.loads(command)
        assert argv[0] == "python"
        # Each role's port variable, pointed away from anything listening here.
        quiet = {
            "SPENDGATE_ADMISSION_PORT": "9",
            "SPENDGATE_DASHBOARD_PORT": "9",
            "SPENDGATE_METRICS_PORT": "9",
        }
        done = subprocess.run(
            [sys.executable, *argv[1:]],
            env={**os.environ, **quiet, **env},
            capture_output=True,
            timeout=30,
        )
        return done.returncode

    @pytest.mark.parametrize(
        "variable",
        ["SPENDGATE_ADMISSION_PORT", "SPENDGATE_DASHBOARD_PORT", "SPENDGATE_METRICS_PORT"],
    )
    def test_healthy_when_the_roles_healthz_answers_200(
        self,
        stages: list[list[Instruction]],
        listener: tuple[HTTPServer, type[_Health]],
        variable: str,
    ) -> None:
        server, _ = listener
        assert self.run(stages, **{variable: str(server.server_address[1])}) == 0

    def test_unhealthy_on_a_503_or_nothing_listening(
        self, stages: list[list[Instruction]], listener: tuple[HTTPServer, type[_Health]]
    ) -> None:
        server, handler = listener
        handler.status = 503  # a stalled worker's /healthz
        assert self.run(stages, SPENDGATE_METRICS_PORT=str(server.server_address[1])) == 1
        assert self.run(stages) == 1
