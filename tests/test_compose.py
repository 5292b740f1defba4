"""docker-compose.yml cannot run here; check it against the settings classes instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from spendgate.admission.settings import AdmissionSettings
from spendgate.dashboard.settings import DashboardSettings
from spendgate.streams.settings import WorkerSettings

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


def _env_names(settings: type[Any]) -> set[str]:
    prefix = settings.model_config["env_prefix"]
    return {f"{prefix}{name}".upper() for name in settings.model_fields}


class TestCompose:
    def setup_method(self) -> None:
        self.compose = yaml.safe_load(COMPOSE.read_text())
        self.services = self.compose["services"]

    def test_has_every_service_with_a_health_check(self) -> None:
        assert set(self.services) == {"kafka", "redis", "worker", "admission", "dashboard"}
        for name, service in self.services.items():
            assert "healthcheck" in service, name

    def test_kafka_is_kraft_4x_and_redis_is_7(self) -> None:
        kafka = self.services["kafka"]
        assert kafka["image"].startswith("apache/kafka:4.")
        assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert self.services["redis"]["image"] == "redis:7"

    def test_ports_match_the_defaults(self) -> None:
        assert "9092:9092" in self.services["kafka"]["ports"]
        assert "6379:6379" in self.services["redis"]["ports"]
        port = AdmissionSettings.model_fields["admission_port"].default
        assert f"{port}:{port}" in self.services["admission"]["ports"]
        metrics = WorkerSettings.model_fields["metrics_port"].default
        assert f"{metrics}:{metrics}" in self.services["worker"]["ports"]
        dash = DashboardSettings.model_fields["dashboard_port"].default
        # Published on loopback only: without a tokens file the page is open.
        assert self.services["dashboard"]["ports"] == [f"127.0.0.1:{dash}:{dash}"]

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
        command = self.services["redis"]["command"]
        flags = dict(zip(command[1::2], command[2::2], strict=True))
        assert flags["--appendonly"] == "yes"
        assert flags["--appendfsync"] == "everysec"
        assert flags["--maxmemory-policy"] == "noeviction"
        assert self.services["redis"]["volumes"]


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
