"""Every command answers --help, and the package exports stay sorted and real."""

from __future__ import annotations

import importlib

import pytest
from typer.testing import CliRunner

from spendgate.cli import app

COMMANDS = [
    [],
    ["dev"],
    ["dev", "up"],
    ["dev", "down"],
    ["dev", "status"],
    ["worker"],
    ["admission"],
    ["policy"],
    ["policy", "apply"],
    ["policy", "list"],
    ["policy", "delete"],
    ["demo"],
]


class TestHelp:
    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "spendgate")
    def test_every_command_has_help(self, command: list[str]) -> None:
        result = CliRunner().invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output


class TestExports:
    @pytest.mark.parametrize("package", ["schemas", "streams", "admission"])
    def test_all_is_sorted_and_resolves(self, package: str) -> None:
        module = importlib.import_module(package)
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name), name
