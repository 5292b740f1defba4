"""Every command answers --help, and the package exports stay sorted and real."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spendgate.cli import app
from tests.fixtures.key_ids import key_id
from tests.fixtures.services import Services

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = [
    [],
    ["dev"],
    ["dev", "up"],
    ["dev", "down"],
    ["dev", "status"],
    ["dev", "cluster"],
    ["dev", "cluster", "up"],
    ["dev", "cluster", "down"],
    ["dev", "cluster", "status"],
    ["worker"],
    ["admission"],
    ["policy"],
    ["policy", "apply"],
    ["policy", "list"],
    ["policy", "delete"],
    ["demo"],
    ["dashboard"],
    ["key-id"],
]


class TestHelp:
    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "spendgate")
    def test_every_command_has_help(self, command: list[str]) -> None:
        result = CliRunner().invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage" in result.output


class TestExports:
    @pytest.mark.parametrize(
        "package", ["spendgate.schemas", "spendgate.streams", "spendgate.admission"]
    )
    def test_all_is_sorted_and_resolves(self, package: str) -> None:
        module = importlib.import_module(package)
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name), name


def _run_cli(
    *args: str, tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The console script's entry point in a child process (its own exit code and stderr);
    without ``env`` overrides Kafka is an address that refuses."""
    env = {**os.environ, "COLUMNS": "80", "SPENDGATE_KAFKA_BOOTSTRAP": "127.0.0.1:1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", "from spendgate.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )


BAD_POLICIES = """\
- id: Bad Id
  match: {}
  group_by: [tenant]
  unit: tokens_x
  limit: -5
  window: 1q
  bucket: 5s
- id: second-one
  match: {}
  group_by: [tenant]
  unit: requests
  limit: 0
  window: 1m
  bucket: 5s
"""


class TestErrors:
    def test_policy_apply_reports_every_invalid_field_of_every_policy_verbatim(
        self, tmp_path: Path
    ) -> None:
        file = tmp_path / "bad.yaml"
        file.write_text(BAD_POLICIES)
        result = _run_cli("policy", "apply", str(file), tmp_path=tmp_path)
        assert result.returncode == 2, result.stderr
        err = result.stderr
        # The pattern arrives whole: the console did not eat [a-z0-9._-] as markup.
        assert "'^[a-z0-9._-]{1,64}$'" in err
        assert "'Bad Id'" in err
        for field in ("field id:", "field unit:", "field limit:", "field window:"):
            assert f"policy 0 (id 'Bad Id') {field}" in err, err
        assert "policy 1 (id 'second-one') field limit:" in err, err
        assert "5 invalid" in err
        # One line per problem, none of them cut by the terminal width.
        assert len([line for line in err.splitlines() if line.startswith("policy ")]) == 5

    def test_an_error_with_brackets_prints_verbatim(self) -> None:
        from rich.console import Console

        from spendgate.cli import say

        out = Console(width=40, record=True, color_system=None)
        say("error:", "red", "key opus|tenant=[acme]|x [bold]not markup[/] " + "k" * 60, out=out)
        text = out.export_text().replace("\n", "")
        assert "key opus|tenant=[acme]|x [bold]not markup[/] " + "k" * 60 in text


class TestKeyId:
    """``spendgate key-id``: what an operator looks a raw API key up by."""

    def test_prints_the_key_id_of_the_deployments_secret(self) -> None:
        # tests/conftest.py sets SPENDGATE_SUBJECT_SECRET to TEST_SECRET.
        result = CliRunner().invoke(app, ["key-id", "sk-live-1"])
        assert result.exit_code == 0, result.output
        assert result.stdout == key_id("sk-live-1") + "\n"
        fields = {"SPENDGATE_SECRET_FIELDS": "api_key,labels.user"}
        labelled = CliRunner().invoke(app, ["key-id", "u-7", "--field", "labels.user"], env=fields)
        assert labelled.stdout == key_id("u-7", "labels.user") + "\n", labelled.output

    def test_reads_the_value_from_stdin_with_a_dash(self) -> None:
        result = CliRunner().invoke(app, ["key-id", "-"], input="sk-live-2\n")
        assert result.exit_code == 0, result.output
        assert result.stdout == key_id("sk-live-2") + "\n"

    def test_refuses_a_field_that_is_not_secret(self) -> None:
        result = CliRunner().invoke(app, ["key-id", "acme", "--field", "tenant"])
        assert result.exit_code == 2
        assert "'tenant' is not a secret field" in result.output
        assert result.stdout == ""

    def test_says_when_the_secret_is_the_public_built_in_one(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("SPENDGATE_SUBJECT_SECRET")
        result = CliRunner().invoke(app, ["key-id", "sk-live-1"])
        assert result.exit_code == 0, result.output
        builtin = b"spendgate built-in subject secret: public, configure your own"
        assert result.stdout == key_id("sk-live-1", secret=builtin) + "\n"
        assert "public built-in secret" in result.stderr


class TestRedisPassword:
    @pytest.mark.parametrize(
        ("url", "shown"),
        [
            ("redis://spendgate:pw-1@redis:6379/0", "redis://spendgate:***@redis:6379/0"),
            ("rediss://:pw-1@10.0.0.5:6380/2", "rediss://:***@10.0.0.5:6380/2"),
            ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ],
    )
    def test_a_printed_redis_url_hides_its_password(self, url: str, shown: str) -> None:
        from spendgate._cli_output import without_password

        assert without_password(url) == shown

    def test_status_names_an_unreachable_redis_without_its_password(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from rich.console import Console

        from spendgate._cli_output import print_decidability

        # Port 1 on loopback refuses at once: the error path prints the URL.
        monkeypatch.setenv("SPENDGATE_REDIS_URL", "redis://spendgate:pw-hunter2@127.0.0.1:1/0")
        out = Console(width=200, record=True, color_system=None)
        print_decidability(out)
        text = out.export_text()
        assert "unknown (Redis at redis://spendgate:***@127.0.0.1:1/0" in text, text
        assert "pw-hunter2" not in text


class TestFlags:
    @pytest.mark.parametrize("command", [*COMMANDS, ["replay"], ["alerts", "tail"]], ids=str)
    def test_no_option_shows_a_bool_metavar(self, command: list[str]) -> None:
        result = CliRunner().invoke(app, [*command, "--help"], terminal_width=100)
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output
        assert "BOOLEAN" not in result.output

    def test_boolean_options_read_as_flags(self) -> None:
        replay = CliRunner().invoke(app, ["replay", "--help"], terminal_width=100).output
        assert "--verify / --no-verify" in replay
        tail = CliRunner().invoke(app, ["alerts", "tail", "--help"], terminal_width=100).output
        assert "--follow / --no-follow" in tail
        assert "--from-beginning " in tail


class TestDemoTable:
    def test_budget_keys_wrap_in_full_on_a_narrow_terminal(self) -> None:
        from rich.console import Console

        from spendgate._demo_view import KeyView, Tally, key_table

        keys = [
            "opus-requests-30s|tenant=initech|api_key=initech-key-2",
            "tenant-tokens-1m|tenant=umbrella",
        ]
        tally = Tally(keys={k: KeyView(limit=10, used=9, unit="requests") for k in keys})
        out = Console(width=80, record=True, color_system=None)
        out.print(key_table(tally, 3.0))
        rows = [line.split("│") for line in out.export_text().splitlines() if "│" in line]
        first_column = "".join(cells[1].strip() for cells in rows if len(cells) > 2)
        for key in keys:
            assert key in first_column, first_column
        assert "…" not in out.export_text()


class TestSetup:
    def test_license_is_an_spdx_string(self) -> None:
        meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
        assert meta["project"]["license"] == "Apache-2.0"

    def test_setup_ends_with_the_two_next_commands(self) -> None:
        script = (ROOT / "scripts" / "setup").read_text().rstrip().splitlines()
        tail = "\n".join(script[-4:])
        assert "bash scripts/demo" in tail
        assert "bash scripts/test" in tail


EXAMPLES = sorted(
    p for p in (ROOT / "examples").iterdir() if p.suffix in {".yaml", ".yml", ".json"}
)


class TestExamples:
    """Every example file goes through ``spendgate policy apply`` as a user runs it: the
    CLI in a child process, with the deployment's key-id settings (the suite's secret)."""

    def test_the_examples_are_found(self) -> None:
        assert {p.name for p in EXAMPLES} >= {"policies.yaml", "demo-policies.yaml"}

    @pytest.mark.integration
    @pytest.mark.parametrize("file", EXAMPLES, ids=lambda p: p.name)
    def test_every_example_policy_file_applies_through_the_cli(
        self, file: Path, services: Services, topic_prefix: str, tmp_path: Path
    ) -> None:
        env = {
            "SPENDGATE_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
            "SPENDGATE_TOPIC_PREFIX": topic_prefix,
        }
        applied = _run_cli("policy", "apply", str(file), tmp_path=tmp_path, env=env)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        listed = _run_cli("policy", "list", tmp_path=tmp_path, env={**env, "COLUMNS": "300"})
        assert listed.returncode == 0, listed.stderr
        # The CLI reports on stderr (stdout stays for data): every policy of the file, each
        # then listed in force (its id a cell of its own row).
        from spendgate.streams.policy_admin import load_policies

        said = applied.stderr.splitlines()
        ids = [line.split()[1] for line in said if line.startswith("applied ")]
        assert ids == [p.id for p in load_policies(file, key_ids=None)], applied.stderr
        cells = {line.split("│")[1].strip() for line in listed.stdout.splitlines() if "│" in line}
        assert set(ids) <= cells, listed.stdout

    def test_a_glob_on_a_secret_field_is_refused_by_the_cli(self, tmp_path: Path) -> None:
        # What broke the demo once: the check runs before anything is published.
        file = tmp_path / "glob.yaml"
        file.write_text(
            "- {id: streams, match: {api_key: 'sk-*'}, unit: requests, limit: 5, window: 1m}\n"
        )
        result = _run_cli("policy", "apply", str(file), tmp_path=tmp_path)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "field match.api_key" in result.stderr
        assert "not a glob" in result.stderr


class TestDemoShowsEverything:
    """The demo is the main job's end-to-end check: it exits 1 when a showcased behaviour
    did not happen (the README's first command then fails, and so does CI)."""

    def test_a_run_that_showed_everything_misses_nothing(self) -> None:
        from spendgate._demo_view import SHOWCASED, Tally

        assert Tally(shown=set(SHOWCASED)).missing() == []
        assert Tally(shown=set(SHOWCASED) - {"delay"}).missing() == ["delay"]

    def test_the_command_fails_naming_what_was_not_shown(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from spendgate import demo
        from spendgate._demo_view import SHOWCASED, Tally

        shown = set(SHOWCASED) - {"overage", "alerts"}
        monkeypatch.setattr(demo, "run_demo", lambda **_: Tally(shown=shown))
        result = CliRunner().invoke(app, ["demo", "--wait", "0"], terminal_width=200)
        assert result.exit_code == 1, result.output
        assert "not shown this run: overage; alerts" in result.output
        monkeypatch.setattr(demo, "run_demo", lambda **_: Tally(shown=set(SHOWCASED)))
        assert CliRunner().invoke(app, ["demo", "--wait", "0"]).exit_code == 0
