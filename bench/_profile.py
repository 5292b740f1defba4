"""Sample a running process with py-spy and summarize where its time goes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")

#: Buckets of frames by the file they live in (first match wins), for the summary.
CATEGORIES = (
    ("spendgate: admission/", "admission/"),
    ("spendgate: streams/", "streams/"),
    ("spendgate: schemas/", "schemas/"),
    ("redis-py", "redis/"),
    ("aiokafka", "aiokafka/"),
    ("faust/mode", "faust/"),
    ("faust/mode", "mode/"),
    ("rocksdict", "rocksdict"),
    ("uvicorn/h11", "uvicorn/"),
    ("uvicorn/h11", "h11/"),
    ("fastapi/starlette", "fastapi/"),
    ("fastapi/starlette", "starlette/"),
    ("pydantic", "pydantic"),
    ("prometheus_client", "prometheus_client/"),
    ("asyncio event loop", "asyncio/"),
    ("json/orjson", "json/"),
)


def pyspy() -> str | None:
    """The py-spy executable next to this interpreter, or on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def start(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (collapsed stacks); None if absent."""
    exe = pyspy()
    if exe is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(pid),
            "-d",
            str(int(seconds)),
            "-f",
            "raw",
            "-r",
            "200",
            "--nonblocking",
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def summarize(path: Path, top: int = 12) -> list[str]:
    """Lines: share of samples per category (inclusive) and the top self-time frames."""
    if not path.exists():
        return [f"(no profile at {path})"]
    total = 0
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        seen: set[str] = set()
        for frame in frames:
            for name, needle in CATEGORIES:
                if needle in frame and name not in seen:
                    seen.add(name)
                    inclusive[name] += count
                    break
        leaf = frames[-1]
        m = _FRAME.match(leaf)
        if m:
            leaf = f"{m['func']} ({_short(m['file'])})"
        self_time[leaf] += count
    if not total:
        return ["(empty profile)"]
    out = [f"samples: {total}", "inclusive share by component (a sample may count in several):"]
    out += [f"  {name:26s} {100 * n / total:5.1f}%" for name, n in inclusive.most_common()]
    out.append("top self-time frames:")
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in self_time.most_common(top)]
    return out


def _short(file: str) -> str:
    for marker in ("site-packages/", "/work/main/", "python3.11/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file
