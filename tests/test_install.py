"""What ``pip install .`` puts into a clean environment: the ``spendgate`` namespace, nothing else.

The repository keeps its top-level folders (``schemas/``, ``streams/``, ``admission/``,
``dashboard/``); ``pyproject.toml`` maps them to ``spendgate.*``. A wheel that installed a
top-level ``schemas`` or ``streams`` would collide with any other project so named.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The folders that install as spendgate.<name>.
MAPPED = ("schemas", "streams", "admission", "dashboard", "spendgate")
#: The names the install must never add at the top level of site-packages.
OLD_NAMES = ("schemas", "streams", "admission", "dashboard")


def _installed_as(path: Path) -> str:
    """Where a file or folder of the repository lands under site-packages."""
    rel = path.relative_to(ROOT).as_posix()
    return rel if rel.startswith("spendgate") else f"spendgate/{rel}"


def _site_packages(env: Path) -> Path:
    found = list((env / "lib").glob("python3*/site-packages"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], Path]:
    """The top-level entries ``pip install .`` added to a fresh venv (no dependencies:
    only this project's own files are judged), and that venv."""
    tmp = tmp_path_factory.mktemp("install")
    # A copy of the working tree: setuptools builds in place (build/, *.egg-info).
    source = tmp / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "node_modules"),
    )
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    (wheel,) = wheels.glob("spendgate-*.whl")
    env = tmp / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    site = _site_packages(env)
    before = {p.name for p in site.iterdir()}
    subprocess.run(
        [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return {p.name for p in site.iterdir()} - before, site


class TestInstall:
    def test_only_spendgate_top_level_packages_are_installed(
        self, installed: tuple[set[str], Path]
    ) -> None:
        added, site = installed
        packages = {n for n in added if not n.endswith((".dist-info", ".pth")) and "__" not in n}
        assert packages == {"spendgate"}, sorted(added)
        for name in OLD_NAMES:
            assert not (site / name).exists(), name
            assert (site / "spendgate" / name / "__init__.py").is_file(), name

    def test_the_installed_packages_carry_their_resources(
        self, installed: tuple[set[str], Path]
    ) -> None:
        _, site = installed
        lua = sorted(p.relative_to(site).as_posix() for p in (site / "spendgate").rglob("*.lua"))
        in_repo = sorted(
            _installed_as(p) for folder in MAPPED for p in (ROOT / folder).rglob("*.lua")
        )
        assert lua == in_repo
        packages = sorted(
            p.parent.relative_to(site).as_posix() for p in (site / "spendgate").rglob("__init__.py")
        )
        in_repo = sorted(
            _installed_as(p.parent)
            for folder in MAPPED
            for p in (ROOT / folder).rglob("__init__.py")
        )
        assert packages == in_repo
        assert (site / "spendgate" / "dashboard" / "static").is_dir()
        assert (site / "spendgate" / "kafka-pom.xml").is_file()


class TestImports:
    @pytest.mark.parametrize("folder", MAPPED)
    def test_every_import_of_the_project_goes_through_the_namespace(self, folder: str) -> None:
        """A bare ``import schemas`` works in a checkout (the folder is on the path) and breaks
        once installed: none may exist."""
        bare = []
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                bare += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {n}"
                    for n in names
                    if n.split(".")[0] in OLD_NAMES
                ]
        assert bare == []
