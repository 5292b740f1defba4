"""The generated reference pages (``docs/reference/``) are what the code gives, and the code
gives them whole: every setting, policy field and metric carries a description, every
``SPENDGATE_*`` variable the code or the scripts name is in the settings reference, every
settings class, metrics module and exit status is listed by the generator."""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from spendgate import _docs_gen
from spendgate._docs_gen import COMMAND, EXIT_CODES, METRICS, OTHER_VARIABLES, PAGES, SETTINGS

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
#: The product's packages (the folders pyproject.toml maps into the spendgate namespace).
PACKAGES = ("schemas", "streams", "admission", "dashboard", "spendgate")
#: What an operator runs besides the packages: the scripts, CI, the compose files.
RUN_FILES = ("scripts", ".ci", "docker-compose.yml", "Dockerfile", "examples")
VARIABLE = re.compile(r"SPENDGATE_[A-Z0-9_]+")


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return _docs_gen.render()


def product_files(suffix: str = ".py") -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob(f"*{suffix}"))


def run_files() -> Iterator[Path]:
    for name in RUN_FILES:
        path = ROOT / name
        yield from sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def named_variables(paths: Iterator[Path]) -> dict[str, str]:
    """Every full ``SPENDGATE_*`` name in ``paths`` -> the first place it is named (a prefix
    such as ``SPENDGATE_KAFKA_*``, ending in ``_``, is no variable)."""
    found: dict[str, str] = {}
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for name in VARIABLE.findall(line):
                if not name.endswith("_"):
                    found.setdefault(name, f"{path.relative_to(ROOT)}:{n}")
    return found


def documented_variables() -> set[str]:
    return set(_docs_gen.settings_variables()) | set(OTHER_VARIABLES)


def undocumented_fields(model: type[BaseModel]) -> list[str]:
    return [name for name, f in model.model_fields.items() if not (f.description or "").strip()]


class TestDrift:
    @pytest.mark.parametrize("name", sorted(PAGES))
    def test_each_page_is_what_the_code_gives(self, name: str, pages: dict[str, str]) -> None:
        path = REFERENCE / name
        hint = f"docs/reference/{name} differs from the code: run `{COMMAND}` and commit it"
        assert path.is_file(), f"{path} is missing. {hint}"
        checked_in = path.read_text(encoding="utf-8")
        if checked_in != pages[name]:
            diff = "".join(
                list(
                    difflib.unified_diff(
                        checked_in.splitlines(keepends=True),
                        pages[name].splitlines(keepends=True),
                        "checked in",
                        "from the code",
                    )
                )[:40]
            )
            pytest.fail(f"{hint}\n{diff}")

    def test_no_stale_pages(self) -> None:
        assert sorted(p.name for p in REFERENCE.iterdir()) == sorted(PAGES), (
            f"docs/reference/ holds a page the generator does not write; run `{COMMAND}`"
        )

    def test_check_exits_1_naming_a_stale_page(
        self, tmp_path: Path, pages: dict[str, str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_docs_gen, "render", lambda names=None: pages)
        assert _docs_gen.main(["--root", str(tmp_path)]) == 0
        assert _docs_gen.main(["--check", "--root", str(tmp_path)]) == 0
        (tmp_path / "docs" / "reference" / "policy.md").write_text("edited by hand\n")
        assert _docs_gen.main(["--check", "--root", str(tmp_path)]) == 1


class TestOpenAPI:
    async def test_the_checked_in_document_is_the_one_admission_serves(self) -> None:
        import json

        import httpx

        from spendgate.admission.server import build_app
        from spendgate.admission.settings import AdmissionSettings

        app = build_app(AdmissionSettings.model_construct())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://admission") as client:
            served = (await client.get("/openapi.json")).json()
        checked_in = json.loads((REFERENCE / "openapi.json").read_text(encoding="utf-8"))
        assert served == checked_in, (
            f"docs/reference/openapi.json is not what admission serves: run `{COMMAND}`"
        )


class TestDescriptions:
    @pytest.mark.parametrize("group", SETTINGS, ids=lambda g: g.name)
    def test_every_setting_has_a_description(self, group: _docs_gen.SettingsGroup) -> None:
        missing = undocumented_fields(group.cls())
        assert not missing, (
            f"{group.module}.{group.name}: give {', '.join(missing)} a "
            f"Field(description=...), then run `{COMMAND}`"
        )

    def test_every_policy_field_has_a_description(self) -> None:
        from spendgate.schemas.policies import Burst, Policy

        for model in (Policy, Burst):
            missing = undocumented_fields(model)
            assert not missing, f"{model.__name__}: give {', '.join(missing)} a description"

    @pytest.mark.parametrize("where", METRICS, ids=lambda m: m.module)
    def test_every_metric_has_help(self, where: _docs_gen.MetricModule) -> None:
        metrics = list(_docs_gen.metric_families(where.module))
        assert metrics, where.module
        assert all(str(m._documentation).strip() for m in metrics)

    def test_the_check_catches_a_field_without_one(self) -> None:
        class Undocumented(BaseSettings):
            model_config = SettingsConfigDict(env_prefix="SPENDGATE_")
            said: int = Field(1, description="A setting with its description.")
            silent: int = 2

        assert undocumented_fields(Undocumented) == ["silent"]


class TestCompleteness:
    def test_every_variable_the_code_and_scripts_name_is_in_the_reference(self) -> None:
        named = named_variables(iter([*product_files(), *product_files(".lua"), *run_files()]))
        missing = {v: where for v, where in named.items() if v not in documented_variables()}
        assert not missing, (
            f"not in docs/reference/settings.md: {missing}; read it through a settings class "
            "listed in spendgate._docs_gen.SETTINGS (with a description), or list it in "
            f"OTHER_VARIABLES, then run `{COMMAND}`"
        )

    def test_every_variable_the_prose_names_exists(self) -> None:
        prose = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
        prose += [p for p in (ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md") if p.is_file()]
        named = named_variables(iter(prose))
        unknown = {v: where for v, where in named.items() if v not in documented_variables()}
        assert not unknown, f"the documentation names variables nothing reads: {unknown}"

    def test_the_scripts_and_tests_variables_are_still_read(self) -> None:
        used = named_variables(
            iter(
                [
                    *run_files(),
                    *sorted((ROOT / "tests").rglob("*.py")),
                    *sorted((ROOT / "bench").rglob("*.py")),
                ]
            )
        )
        stale = sorted(set(OTHER_VARIABLES) - set(used))
        assert not stale, f"OTHER_VARIABLES lists what nothing reads any more: {stale}"

    def test_every_settings_class_is_listed(self) -> None:
        listed = {(g.module.removeprefix("spendgate."), g.name) for g in SETTINGS}
        found = set()
        for path in product_files():
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and any(
                    (isinstance(b, ast.Name) and b.id.endswith("Settings"))
                    or (isinstance(b, ast.Attribute) and b.attr.endswith("Settings"))
                    for b in node.bases
                ):
                    found.add((module.removeprefix("spendgate."), node.name))
        assert found - listed == set(), (
            "settings classes missing from spendgate._docs_gen.SETTINGS (their variables "
            f"would be missing from the reference): {sorted(found - listed)}"
        )
        assert listed - found == set(), sorted(listed - found)

    def test_every_metrics_module_is_listed(self) -> None:
        kinds = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
        defining = set()
        for path in product_files():
            text = path.read_text(encoding="utf-8")
            if "prometheus_client" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module == "prometheus_client"
                    and kinds & {a.name for a in node.names}
                ):
                    defining.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
        listed = {m.module.removeprefix("spendgate.") for m in METRICS}
        assert {d.removeprefix("spendgate.") for d in defining} == listed

    def test_every_registered_spendgate_family_is_in_the_reference(
        self, pages: dict[str, str]
    ) -> None:
        from prometheus_client import REGISTRY

        for where in METRICS:
            list(_docs_gen.metric_families(where.module))  # imported: registered
        names = {f.name for f in REGISTRY.collect() if f.name.startswith("spendgate_")}
        page = pages["metrics.md"]
        missing = [n for n in sorted(names) if f"`{n}`" not in page and f"`{n}_total`" not in page]
        assert not missing, missing


def _exit_codes_in(path: Path) -> Iterator[tuple[int, int]]:
    """(line, code) of every literal exit status in ``path``: ``sys.exit(n)``,
    ``SystemExit(n)``, ``typer.Exit(n)``, ``os._exit(n)`` and ``EXIT_* = n``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if (
                name in {"exit", "_exit", "Exit", "SystemExit"}
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, int)
                and not isinstance(arg.value, bool)
            ):
                yield node.lineno, arg.value
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id.startswith("EXIT_"):
                    yield node.lineno, int(node.value.value)


class TestExitCodes:
    def test_every_exit_status_in_the_code_is_listed(self) -> None:
        listed = {e.code for e in EXIT_CODES}
        unlisted = [
            f"{path.relative_to(ROOT)}:{line} exits {code}"
            for path in product_files()
            for line, code in _exit_codes_in(path)
            if code not in listed
        ]
        assert not unlisted, f"add them to spendgate._docs_gen.EXIT_CODES: {unlisted}"

    def test_the_worker_codes_are_the_code_s_own(self) -> None:
        from spendgate.streams.liveness import EXIT_STALLED

        worker = {e.code for e in EXIT_CODES if e.command == "`spendgate worker`"}
        assert worker == {0, 1, 2, EXIT_STALLED}

    def test_the_cli_maps_errors_to_2_and_timeouts_to_3(self) -> None:
        codes = {code for path in (ROOT / "spendgate").glob("cli*") for code in _cli_codes(path)}
        assert {1, 2, 3} <= codes
        assert codes <= {e.code for e in EXIT_CODES if "spendgate" in e.command}


def _cli_codes(path: Path) -> Iterator[int]:
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    for file in files:
        for _, code in _exit_codes_in(file):
            yield code
