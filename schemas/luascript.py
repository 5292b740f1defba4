"""Redis Lua scripts as package resources: one ``.lua`` file per script or library.

Every script lives in a ``.lua`` file beside the Python module that holds its contract (the
args type that encodes its KEYS and ARGV, the reply type that decodes what it returns).
A file's header says, by role, its KEYS, its ARGV and its reply. A script uses a library
with a line of its own::

    --! include spendgate.schemas:window

which :func:`load` replaces by that library's source (``window.lua`` in the package
``spendgate.schemas``), each library once. Libraries define ``local function`` (and local
constants) only: they read no KEYS or ARGV and set no globals.

The contract modules encode and decode with the three primitives here: an optional
argument is ``""`` for None (:func:`optional_arg`), an optional reply value is ``""`` when
missing (:func:`optional_int`), and a reply value is bytes or an int, whatever redis-py
returned (:func:`as_text`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

__all__ = [
    "LuaScript",
    "as_text",
    "compose",
    "load",
    "optional_arg",
    "optional_int",
    "run_script",
    "text_of",
]

_INCLUDE = re.compile(r"^--! include (?P<package>[\w.]+):(?P<name>\w+)\s*$")


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script's full source (its libraries included) and the SHA1 Redis knows it by."""

    name: str
    source: str

    @property
    def sha(self) -> str:
        """The SHA1 of the source, as ``SCRIPT LOAD`` returns it."""
        return hashlib.sha1(self.source.encode()).hexdigest()


async def run_script(
    client: Any, script: LuaScript, keys: Sequence[str], args: Sequence[bytes | str | int]
) -> Any:
    """Run ``script`` on ``client`` (a Redis or a Redis Cluster client, which routes the
    call by its keys): by SHA, and by source when the node does not know it yet (a new
    node, a promoted replica, a restarted server), which also caches it there."""
    try:
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.execute_command("EVAL", script.source, len(keys), *keys, *args)


def optional_arg(value: int | None) -> int | str:
    """An optional integer as a script argument: ``""`` for None."""
    return "" if value is None else value


def optional_int(raw: int | bytes | str) -> int | None:
    """An optional integer a script returned as text: None for ``""``."""
    return None if raw in (b"", "") else int(raw)


def as_text(value: bytes | str | int) -> str:
    """A value of a script's reply (or of a hash) as text, whatever redis-py returned."""
    return value.decode() if isinstance(value, bytes) else str(value)


@cache
def text_of(package: str, name: str) -> str:
    """The text of ``name``.lua in ``package``, as the file holds it (no include expanded).

    Raises:
        FileNotFoundError: no such file in the package.
    """
    path = resources.files(package).joinpath(f"{name}.lua")
    if not path.is_file():
        raise FileNotFoundError(f"no Lua file {name}.lua in package {package}")
    return path.read_text(encoding="utf-8")


def compose(text: str, seen: set[tuple[str, str]] | None = None) -> str:
    """``text`` with each ``--! include`` line replaced by the library it names (recursively,
    each library once)."""
    seen = set() if seen is None else seen
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        found = _INCLUDE.match(line)
        if found is None:
            out.append(line)
            continue
        ref = (found["package"], found["name"])
        if ref not in seen:
            seen.add(ref)
            out.append(compose(text_of(*ref), seen))
    return "".join(out)


@cache
def load(package: str, name: str) -> LuaScript:
    """The script ``name``.lua of ``package``, its libraries included.

    Raises:
        FileNotFoundError: no such file in the package.
    """
    return LuaScript(f"{package}:{name}", compose(text_of(package, name)))
