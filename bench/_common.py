"""Shared helpers of the benchmarks: subprocesses, ports, percentiles, plots, cleanup."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from spendgate.schemas.shards import Topology

ROOT = Path(__file__).resolve().parent.parent
PLOTS = ROOT / "bench" / "plots"
KAFKA = os.environ.get("SPENDGATE_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
REDIS = os.environ.get("SPENDGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The partitions of the worker the admission benchmarks stand in for (no worker runs:
#: they write windows straight into Redis and every applied mark, caught up).
STAND_IN = Topology(usage=4, keyed=4)


def run_id(kind: str) -> str:
    """A unique name stem for this run's topics and Redis keys (``bench<kind><hex>``)."""
    return f"bench{kind}{uuid.uuid4().hex[:8]}"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(port: int, path: str = "/healthz", timeout_s: float = 30.0) -> None:
    """Wait until ``GET path`` answers on loopback (any status)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing answered on :{port}{path} within {timeout_s}s")


#: ``prctl(2)`` (Linux), looked up here: the child calls it between fork and exec, where
#: nothing may import or take a lock.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """In the child, before exec: be SIGKILLed when ``parent`` dies (Linux), or exit now if
    it is already gone. A benchmark killed by a timeout (SIGKILL: no ``finally`` runs)
    leaves none of its children behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def process(
    argv: Sequence[str], env: dict[str, str], log: Path, cwd: Path = ROOT
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a child process for the block; SIGTERM then SIGKILL it afterwards (by pid).

    The child also dies with this process, however it ends (``_die_with``)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            list(argv),
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            preexec_fn=lambda: _die_with(parent),
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


#: The folders a checkout installs inside the ``spendgate`` namespace (pyproject.toml's
#: ``package-dir``), beside the files of its own ``spendgate/`` folder.
NAMESPACE_DIRS = ("schemas", "streams", "admission", "dashboard")


def checkout_label(root: Path) -> str:
    """A checkout's last commit (hash and subject) and how many tracked files differ from it,
    for a benchmark's header."""

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *argv], capture_output=True, text=True, check=False
        )
        return done.stdout.strip()

    dirty = len(git("status", "--porcelain", "--untracked-files=no").splitlines())
    return git("log", "-1", "--format=%h %s")[:70] + (
        f" + {dirty} uncommitted file(s)" if dirty else ""
    )


def namespace_tree(checkout: Path, dest: Path) -> Path:
    """A tree of links laid out as ``checkout`` installs (as ``scripts/check`` builds for
    mypy): ``dest/spendgate/`` a real folder holding a link to each entry of
    ``checkout/spendgate/`` and to each of its top-level package folders. With ``dest``
    first on ``sys.path`` (and the working directory elsewhere than a checkout),
    ``import spendgate`` is ``checkout``'s code, whatever the interpreter has installed
    editable: the editable install's finder comes after the path finder. Returns ``dest``."""
    checkout = checkout.resolve()
    package = dest / "spendgate"
    package.mkdir(parents=True)
    if not (checkout / "spendgate" / "__init__.py").is_file():
        raise FileNotFoundError(f"{checkout} has no spendgate/__init__.py: not a checkout")
    for entry in sorted((checkout / "spendgate").iterdir()):
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in NAMESPACE_DIRS:
        (package / name).symlink_to(checkout / name, target_is_directory=True)
    return dest


@contextlib.contextmanager
def piped(argv: Sequence[str], env: dict[str, str], cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """Like :func:`process`, with the child's stdin and stdout as text pipes (stderr
    inherited) for a line protocol and ``env`` its whole environment (not added to this
    one's); the child is stopped afterwards (by pid) and dies with this process."""
    parent = os.getpid()
    proc = subprocess.Popen(
        list(argv),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=lambda: _die_with(parent),
    )
    try:
        yield proc
    finally:
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` (nearest-rank on the sorted list)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary_ms(latencies_s: Sequence[float]) -> dict[str, float]:
    """p50/p99/p99.9/max in milliseconds."""
    return {
        "p50_ms": pct(latencies_s, 50) * 1000,
        "p99_ms": pct(latencies_s, 99) * 1000,
        "p999_ms": pct(latencies_s, 99.9) * 1000,
        "max_ms": (max(latencies_s) * 1000) if latencies_s else float("nan"),
    }


def machine() -> dict[str, str]:
    """What this ran on: CPU model, cores, RAM, versions."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) // 1024} MiB"
    load = "?"
    with contextlib.suppress(OSError):
        load = Path("/proc/loadavg").read_text().split()[0]
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "ram": mem,
        "loadavg_1m_at_start": load,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def print_header(title: str, params: dict[str, object]) -> None:
    """Print the benchmark's title, parameters and machine as the first lines."""
    print(f"== {title}")
    print("machine: " + json.dumps(machine()))
    print("params:  " + json.dumps(params, default=str))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain aligned table (also valid as a Markdown table)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


#: Targets judged NOT MET in this process (``--check`` turns any into exit status 1).
MISSED: list[str] = []


def verdict(ok: bool, what: str = "") -> str:
    """``MET`` / ``NOT MET`` for a target, remembering a miss for :func:`exit_status`."""
    if not ok:
        MISSED.append(what or f"target #{len(MISSED) + 1}")
    return "MET" if ok else "NOT MET"


def add_check_flag(ap: argparse.ArgumentParser) -> None:
    """The ``--check`` flag every benchmark takes."""
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 when any target is NOT MET (for CI and claims)",
    )


def exit_status(check: bool) -> int:
    """0, or 1 under ``--check`` when a target was missed (printed on stderr)."""
    if check and MISSED:
        print(f"--check: {len(MISSED)} target(s) NOT MET: {', '.join(MISSED)}", file=sys.stderr)
        return 1
    return 0


def delete_redis_prefix(url: str, prefix: str) -> int:
    """Delete every Redis key starting with ``prefix`` (this run's keys only)."""
    import redis

    client = redis.Redis.from_url(url)
    n = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=2000):
            batch.append(key)
            if len(batch) >= 1000:
                n += int(client.delete(*batch))
                batch = []
        if batch:
            n += int(client.delete(*batch))
    finally:
        client.close()
    return n


def delete_topics(bootstrap: str, prefix: str) -> None:
    """Delete every topic whose name starts with ``prefix`` (this run's topics only)."""
    from aiokafka.admin import AIOKafkaAdminClient

    async def _go() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            names = [t for t in await admin.list_topics() if t.startswith(prefix)]
            if names:
                await admin.delete_topics(names)
        finally:
            await admin.close()

    with contextlib.suppress(Exception):
        asyncio.run(_go())


@dataclass
class Series:
    """One latency sample series for a CDF plot."""

    label: str
    latencies_s: list[float]


def plot_cdf(path: Path, title: str, series: Sequence[Series]) -> Path:
    """Latency percentile plot (x: percentile on a log 'nines' scale, y: ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for s in series:
        if not s.latencies_s:
            continue
        data = np.sort(np.asarray(s.latencies_s) * 1000)
        q = (np.arange(1, len(data) + 1) - 0.5) / len(data)
        x = 1 / (1 - q)
        ax.plot(x, data, label=f"{s.label} (n={len(data)})", linewidth=1.4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [2, 10, 100, 1000]
    ax.set_xticks(ticks)
    ax.set_xticklabels(["p50", "p90", "p99", "p99.9"])
    ax.set_xlim(1, 2000)
    ax.set_ylabel("latency (ms, log)")
    ax.set_xlabel("percentile")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def python() -> str:
    """This interpreter (the project's venv when run as documented)."""
    return sys.executable
