"""Smoke runs of the benchmarks: each runs in its tiny ``--smoke`` mode and prints its
figures beside its baseline. Performance targets are not asserted here (a smoke run is too
small to measure them; ``--check`` on a full run does), except overshoot's, which is a
correctness target: 0 units over the limit, read from the "units over limit" column of
every spendgate row, under ``--check``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spendgate.devcluster import LocalCluster
from tests.fixtures.admission import OwnRedis
from tests.fixtures.services import Services

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, services: Services, timeout_s: float = 60.0, *extra: str) -> str:
    env = {
        **os.environ,
        "SPENDGATE_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
        "SPENDGATE_REDIS_URL": services.redis_url,
    }
    # Its own process group: whatever the benchmark starts is found (and, on a timeout,
    # stopped) by the group's id, and none of it may outlive the benchmark.
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--smoke", *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{module} did not finish in {timeout_s} s:\n{stdout}\n{stderr}")
    finally:
        left = _group_members(proc.pid)
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"{module} left its children running: {left}"
    assert proc.returncode == 0, f"{module} failed:\n{stdout}\n{stderr}"
    return stdout


def _group_members(pgid: int, grace_s: float = 5.0) -> list[str]:
    """The live processes of process group ``pgid`` (their command lines), after waiting up
    to ``grace_s`` for them to go (a child SIGKILLed with its parent takes a moment)."""
    deadline = time.monotonic() + grace_s
    while True:
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            # fields: state, ppid, pgrp, ...; a zombie (Z) has already exited.
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(cmdline.replace(b"\0", b" ").decode(errors="replace").strip())
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def _tables(out: str) -> list[list[dict[str, str]]]:
    """The rows of every table ``bench._common.print_table`` printed, by header."""
    blocks: list[list[str]] = [[]]
    for line in out.splitlines():
        if line.startswith("|"):
            if not line.startswith("|-"):  # the header's underline
                blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    tables = []
    for lines in (b for b in blocks if b):
        headers = [h.strip() for h in lines[0].strip("|").split("|")]
        tables.append(
            [
                dict(zip(headers, (c.strip() for c in line.strip("|").split("|")), strict=True))
                for line in lines[1:]
            ]
        )
    return tables


def _table(out: str) -> list[dict[str, str]]:
    """The rows of the first table ``bench._common.print_table`` printed, by header."""
    return _tables(out)[0]


class TestCheckMode:
    def test_a_missed_target_makes_check_exit_non_zero(self) -> None:
        from bench import _common as c

        c.MISSED.clear()
        assert c.verdict(True, "met") == "MET"
        assert c.exit_status(True) == 0
        assert c.verdict(False, "missed") == "NOT MET"
        assert c.exit_status(False) == 0  # without --check a run only reports
        assert c.exit_status(True) == 1
        c.MISSED.clear()

    @pytest.mark.parametrize(
        "module", ["admission", "processor", "replay", "memory", "overshoot", "cluster"]
    )
    def test_every_benchmark_takes_check(self, module: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", f"bench.{module}", "--help"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0 and "--check" in done.stdout


@pytest.mark.integration
class TestBenchSmoke:
    def test_admission(self, services: Services) -> None:
        out = _run("bench.admission", services)
        assert "spendgate /v1/admit, 1 budget(s)" in out
        assert "baseline lua direct" in out
        assert "baseline empty endpoint" in out
        assert "targets:" in out
        (refused,) = [r for r in _table(out) if r["run"].startswith("spendgate /v1/admit refused")]
        assert refused["statuses"].startswith("429:") and "," not in refused["statuses"], refused
        assert refused["window"] == "1h", refused
        summary = _tables(out)[-1]
        assert [r["window"] for r in summary] == ["1h / 1m"], summary

    def test_admission_windows(self, services: Services) -> None:
        """Two windows in one run, each on its own keys: Lua direct and /v1/admit rows,
        admitted and refused, for both, and the summary table by window (several windows
        skip the open-loop and multi-process runs)."""
        out = _run("bench.admission", services, 90.0, "--window", "1m,24h")
        rows = _table(out)
        for window in ("1m", "24h"):
            mine = {r["run"]: r for r in rows if r["window"] == window}
            for run, status in (
                ("spendgate /v1/admit, 1 budget(s)", "200"),
                ("baseline lua direct, 1 budget(s)", "200"),
                ("spendgate /v1/admit refused, 1 budget", "429"),
                ("baseline lua direct refused, 1 budget", "429"),
            ):
                assert mine[run]["statuses"].split(":")[0] == status, mine[run]
                assert "," not in mine[run]["statuses"], mine[run]
            lua = mine["baseline lua direct, 1 budget(s)"]
            assert float(lua["Redis script us/req"].replace(",", "")) > 0, lua
        assert all(r["load"] == "closed" for r in rows), rows
        assert "window 1m / 1s:" in out and "window 24h / 1m:" in out
        assert "summary by window" in out
        summary = _tables(out)[-1]
        assert [r["window"] for r in summary] == ["1m / 1s", "24h / 1m"], summary
        for row in summary:
            assert float(row["lua 1 /s"].replace(",", "")) > 0, row
            assert float(row["lua refused 1 /s"].replace(",", "")) > 0, row
            assert float(row["admit 1 /s"].replace(",", "")) > 0, row

    def test_admission_ab_against_itself(self, services: Services) -> None:
        """Both servers run and answer as expected (the tool fails on any other status)."""
        out = _run("bench.admission_ab", services, 120.0, "--against", str(ROOT))
        rows = _table(out)
        assert [(r["requests"], r["server"]) for r in rows] == [
            ("admitted", "this"),
            ("admitted", "against"),
            ("refused", "this"),
            ("refused", "against"),
        ]
        assert all(int(r["n"].replace(",", "")) > 0 for r in rows), rows

    def test_admit_script_ab_against_a_copy(
        self, services: Services, own_redis: OwnRedis, tmp_path: Path
    ) -> None:
        """Both checkouts' helpers run their own code (the copy's modules are imported from
        the copy, not from the installed checkout), every case runs and both decide alike
        (the tool fails otherwise). On a Redis of its own: the tool times its scripts by
        Redis's command statistics and refuses a server where other clients run scripts
        (the rest of the suite does, on the shared one)."""
        services = Services(services.kafka_bootstrap, own_redis.url)
        other = tmp_path / "other"
        for name in ("spendgate", "schemas", "streams", "admission", "dashboard"):
            shutil.copytree(ROOT / name, other / name, ignore=shutil.ignore_patterns("__pycache__"))
        out = _run("bench.admit_script_ab", services, 120.0, "--against", str(other))
        assert f"new: imports {ROOT / 'schemas' / '__init__.py'};" in out
        assert f"old: imports {other.resolve() / 'schemas' / '__init__.py'};" in out
        rows = _table(out)
        assert [(r["window"], r["budgets"], r["requests"]) for r in rows] == [
            (w, b, p)
            for w in ("1h / 1m", "24h / 1m")
            for b in ("1", "5")
            for p in ("admitted", "refused")
        ]
        for row in rows:
            assert float(row["new us/call"].replace(",", "")) > 0, row
            assert float(row["old us/call"].replace(",", "")) > 0, row

    def test_overshoot(self, services: Services) -> None:
        out = _run("bench.overshoot", services, 60.0, "--check")  # exits 1 on a miss
        rows = _table(out)
        spendgate = [r for r in rows if r["limiter"] == "spendgate"]
        baseline = [r for r in rows if r["limiter"] == "fixed-window (baseline)"]
        assert {r["scenario"] for r in spendgate} == {"exact", "variable"}
        assert len(baseline) == len(spendgate)
        for row in spendgate:
            assert row["units over limit"] == "0", row
            assert row["errors"] == "0", row
            assert int(row["admitted"].replace(",", "")) > 0, row
        assert "units over the limit, worst trial = 0 (target 0: MET)" in out

    def test_key_steps_profile(self, services: Services) -> None:
        out = _run("bench.key_steps_profile", services)
        rows = [line for line in out.splitlines() if line.startswith("| 1h |")]
        rows += [line for line in out.splitlines() if line.startswith(("| 24h |", "| 31d |"))]
        assert len(rows) == 6, out  # 3 windows, without and with reservations pending
        assert "redis.call us" in out
        for row in rows:
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            assert all(float(v) >= 0 for v in cells[2:]), row

    def test_memory(self, services: Services) -> None:
        out = _run("bench.memory", services)
        assert "Redis MEMORY USAGE B" in out
        assert "baseline: empty window MEMORY USAGE B" in out
        assert "baseline: value without dedupe B" in out

    def test_processor(self, services: Services) -> None:
        out = _run("bench.processor", services, timeout_s=120.0)
        assert "spendgate worker (split + account + Redis)" in out
        assert "baseline: raw aiokafka consume" in out
        assert "spendgate: produced -> visible in Redis" in out
        assert "baseline: produced -> consumable (raw)" in out

    def test_replay(self, services: Services) -> None:
        out = _run("bench.replay", services)
        assert "spendgate replay()" in out
        assert "baseline: raw aiokafka consume" in out

    @pytest.mark.cluster
    def test_cluster(self, services: Services, redis_cluster: LocalCluster) -> None:
        out = _run("bench.cluster", services, 180.0, "--check")  # exits 1 on a miss
        rows = _table(out)
        assert [(r["requests"], r["durability"]) for r in rows] == [
            ("home shard", "WAIT 1"),
            ("across shards", "WAIT 1"),
            ("home shard", "no WAIT"),
            ("across shards", "no WAIT"),
        ]
        # One script call on the home shard; across two shards: the answer's lookup, a
        # piece per shard, the seal and the unlisting pipeline.
        assert [r["Redis round trips/admit"] for r in rows] == ["1.00", "5.00", "1.00", "5.00"]
        assert "the shared key holds exactly them: MET" in out
