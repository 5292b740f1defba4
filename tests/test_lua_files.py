"""Every Redis script is a ``.lua`` file with a header by role and one contract module.

A script's header names its contract (``-- Contract: <module>``), whose ``SCRIPT`` is that
file with its includes expanded, and says its KEYS, ARGV and reply. A library (``--
Library:``) reads no keys or arguments and defines nothing global. No Lua is left in a
Python string.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from spendgate.schemas.luascript import compose

ROOT = Path(__file__).resolve().parents[1]
#: The folders of the installed packages, and the package each one is.
PACKAGES = {
    "schemas": "spendgate.schemas",
    "streams": "spendgate.streams",
    "admission": "spendgate.admission",
    "dashboard": "spendgate.dashboard",
    "spendgate": "spendgate",
}
LUA = sorted(p for folder in PACKAGES for p in (ROOT / folder).rglob("*.lua"))


def _code(text: str) -> str:
    """The Lua without its comments (``--`` to the end of the line; no script has a
    ``--`` inside a string)."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join((PACKAGES[rel.parts[0]], *rel.parts[1:]))


def _is_library(text: str) -> bool:
    return any(line.startswith("-- Library:") for line in text.splitlines()[:5])


SCRIPTS = [p for p in LUA if not _is_library(p.read_text())]
LIBRARIES = [p for p in LUA if _is_library(p.read_text())]


def test_the_scripts_are_all_here() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert names == {
        "admission/scripts/admit.lua",
        "admission/scripts/extend.lua",
        "admission/scripts/settle.lua",
        "admission/scripts/seal.lua",
        "admission/scripts/tombstone.lua",
        "admission/scripts/claim_unpublished.lua",
        "streams/scripts/absorb.lua",
        "streams/scripts/heal.lua",
        "streams/scripts/claim.lua",
        "streams/scripts/adopt.lua",
        "streams/scripts/sample.lua",
        "streams/scripts/mark.lua",
    }
    assert {p.name for p in LIBRARIES} == {
        "window.lua",
        "window_view.lua",
        "burst.lua",
        "redis_values.lua",
        "key_steps.lua",
    }


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
class TestScripts:
    def test_the_header_says_keys_argv_and_reply_by_role(self, path: Path) -> None:
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("--"):
                break
            header.append(line)
        for section in ("-- KEYS", "-- ARGV", "-- Reply"):
            assert any(line.startswith(section) for line in header), section
        assert header[0].startswith(f"-- {path.stem.upper()}: ")

    def test_its_contract_module_loads_this_file(self, path: Path) -> None:
        found = re.search(r"^-- Contract: ([\w.]+)$", path.read_text(), re.MULTILINE)
        assert found, "no '-- Contract: <module>' line"
        assert found[1] == _module_of(path)
        module = importlib.import_module(found[1])
        assert module.SCRIPT.source == compose(path.read_text())
        assert "--! include" not in module.SCRIPT.source


@pytest.mark.parametrize("path", LIBRARIES, ids=lambda p: p.name)
def test_a_library_reads_no_keys_and_defines_only_locals(path: Path) -> None:
    code = _code(path.read_text())
    assert "KEYS" not in code and "ARGV" not in code
    for line in code.splitlines():
        if line.startswith("function") or re.match(r"^[A-Za-z_]\w*\s*=", line):
            pytest.fail(f"global definition: {line!r}")


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_no_lua_is_left_in_a_python_string(folder: str) -> None:
    found = [
        str(p.relative_to(ROOT))
        for p in (ROOT / folder).rglob("*.py")
        if "redis.call(" in p.read_text()
    ]
    assert found == []
