"""The options every command shares: ``--version``, ``-h``, ``--port``, ``--log-level`` and
``--output``; a bad value exits 2 naming what it may be."""

from __future__ import annotations

import os
import re
from importlib.metadata import version
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from spendgate.cli import app


def _tree(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and group under ``command``, read from the click tree typer builds
    (a command added later is covered without editing a list)."""
    found = [path]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        found += _tree(sub, (*path, name))
    return found


ALL = _tree(typer.main.get_command(app))
LISTING = [
    ("policy", "list"),
    ("budgets",),
    ("alerts", "tail"),
    ("dev", "status"),
    ("dev", "cluster", "status"),
    ("simulate",),
]
SERVICES = [("worker",), ("admission",), ("dashboard",)]


def _ids(path: tuple[str, ...]) -> str:
    return " ".join(path) or "spendgate"


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), terminal_width=80)


class TestVersion:
    def test_version_prints_the_installed_package_version(self) -> None:
        result = _invoke("--version")
        assert result.exit_code == 0, result.output
        assert result.stdout == f"spendgate {version('spendgate')}\n"

    def test_the_walked_tree_reaches_every_level(self) -> None:
        assert {(), ("dev",), ("dev", "cluster", "status"), ("key-id",)} <= set(ALL)
        assert set(LISTING) | set(SERVICES) <= set(ALL)


class TestShortHelp:
    @pytest.mark.parametrize("path", ALL, ids=_ids)
    def test_h_is_help_on_every_command_and_group(self, path: tuple[str, ...]) -> None:
        short = _invoke(*path, "-h")
        assert short.exit_code == 0, short.output
        assert short.output == _invoke(*path, "--help").output
        assert "-h, --help" in short.output

    def test_the_top_level_help_cuts_no_command_description_at_80_columns(self) -> None:
        out = _invoke("-h").output
        assert max(len(line) for line in out.splitlines()) <= 80
        flat = " ".join(out.split())
        root = typer.main.get_command(app)
        for name, command in root.commands.items():  # type: ignore[attr-defined]
            first = " ".join((command.help or "").split("\n\n")[0].split())
            assert f"{name} {first}" in flat, (name, first)


def _served(monkeypatch: pytest.MonkeyPatch, module: str) -> list[Any]:
    """Replace ``module``'s serve with a recorder of the settings it is given."""
    seen: list[Any] = []
    monkeypatch.setattr(f"{module}.serve", lambda settings, **_: seen.append(settings))
    monkeypatch.setattr("spendgate.logs.configure", lambda **_: None)
    return seen


class TestPort:
    @pytest.mark.parametrize(
        ("command", "module", "field"),
        [
            ("admission", "spendgate.admission.server", "admission_port"),
            ("dashboard", "spendgate.dashboard.server", "dashboard_port"),
        ],
    )
    def test_the_option_sets_the_setting_the_variable_sets(
        self, monkeypatch: pytest.MonkeyPatch, command: str, module: str, field: str
    ) -> None:
        seen = _served(monkeypatch, module)
        monkeypatch.setenv(f"SPENDGATE_{field.upper()}", "18001")
        assert _invoke(command).exit_code == 0
        assert _invoke(command, "--port", "18002").exit_code == 0
        assert [getattr(s, field) for s in seen] == [18001, 18002]

    def test_admission_workers_read_the_port_from_the_environment(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        seen = _served(monkeypatch, "spendgate.admission.server")
        # setenv first: monkeypatch then restores the variable the command sets.
        monkeypatch.setenv("SPENDGATE_ADMISSION_PORT", "18001")
        assert _invoke("admission", "--workers", "2", "--port", "18003").exit_code == 0
        assert os.environ["SPENDGATE_ADMISSION_PORT"] == "18003"
        assert seen[0].admission_port == 18003

    @pytest.mark.parametrize("command", ["admission", "dashboard"])
    @pytest.mark.parametrize("bad", ["0", "65536", "http", "-1", "8787.0"])
    def test_a_bad_port_exits_2_naming_the_range(self, command: str, bad: str) -> None:
        result = _invoke(command, "--port", bad)
        assert result.exit_code == 2, result.output
        assert f"{bad!r} is not a port: an integer from 1 to 65535" in result.output


class TestLogLevel:
    @pytest.mark.parametrize("path", SERVICES, ids=_ids)
    def test_the_level_reaches_the_root_logger_set_up(
        self, monkeypatch: pytest.MonkeyPatch, path: tuple[str, ...]
    ) -> None:
        calls: list[dict[str, Any]] = []
        monkeypatch.setattr("spendgate.logs.configure", lambda **kw: calls.append(kw))
        for module in ("spendgate.admission.server", "spendgate.dashboard.server"):
            monkeypatch.setattr(f"{module}.serve", lambda *_, **__: None)
        monkeypatch.setattr("spendgate.streams.worker.run_worker", lambda _: None)
        monkeypatch.setattr("spendgate.streams.settings.load_settings", lambda: None)
        assert _invoke(*path).exit_code == 0
        assert _invoke(*path, "--log-level", "DEBUG", "--json-logs").exit_code == 0
        assert calls == [
            {"json_logs": False, "level": "INFO"},
            {"json_logs": True, "level": "DEBUG"},
        ]

    @pytest.mark.parametrize("path", SERVICES, ids=_ids)
    def test_a_bad_level_exits_2_naming_the_choices(self, path: tuple[str, ...]) -> None:
        result = _invoke(*path, "--log-level", "loud")
        assert result.exit_code == 2, result.output
        assert re.search(
            r"'loud' is not one of\s+'debug',\s+'info',\s+'warning',\s+'error',\s+'critical'",
            result.output,
        ), result.output


class TestOutputChoice:
    @pytest.mark.parametrize("path", LISTING, ids=_ids)
    @pytest.mark.parametrize("flag", ["--output", "-o"])
    def test_a_bad_output_exits_2_naming_the_choices(
        self, path: tuple[str, ...], flag: str
    ) -> None:
        result = _invoke(*path, flag, "xml")
        assert result.exit_code == 2, result.output
        assert re.search(r"'xml' is not one of\s+'table',\s+'json'", result.output)

    @pytest.mark.parametrize("path", LISTING, ids=_ids)
    def test_every_listing_command_offers_json(self, path: tuple[str, ...]) -> None:
        assert "-o, --output <table|json>" in _invoke(*path, "-h").output
