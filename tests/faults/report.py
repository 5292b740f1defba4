"""Run the fault and abuse suite and regenerate ``tests/faults/REPORT.md`` from its figures.

Usage (from the repository root)::

    .venv/bin/python -m tests.faults.report [extra pytest arguments]

Each test writes a JSON record of what it injected and observed into the folder named by
``SPENDGATE_FAULTS_RESULTS`` (see ``tests/faults/conftest.py``); this module points that
variable at a fresh folder, runs ``pytest tests/faults`` with a JUnit XML report, and
renders both into REPORT.md. The exit status is pytest's.

REPORT.md is written only by this command: beside it, ``REPORT.json`` keeps everything
the rendering used (records, outcomes, timings, environment), and
``tests/faults/test_report.py`` checks that REPORT.md is exactly ``render()`` of it, so a
hand edit of the report fails the suite.

Provenance: REPORT.json records the commit the run was made from and whether the checkout
had uncommitted changes then (which files). ``test_report`` fails when a file under
``tests/faults/`` (the report's own two files aside) differs from that commit, so commit
the fault tests first, then run this command; it lists the product files changed since
the report's commit without failing (a stale report is visible, not red).
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REPORT = Path(__file__).resolve().parent / "REPORT.md"
INPUTS = REPORT.with_suffix(".json")
COMMAND = ".venv/bin/python -m tests.faults.report"
SEED_ENV = "SPENDGATE_TEST_SEED"
#: The suite run by the command (this module's own test checks the rendering, not faults).
SELF_TEST = "tests/faults/test_report.py"
#: The fault tests (a change here after the report's commit fails ``test_report``) and the
#: report's own files, written after the run and so never part of its commit.
FAULTS_DIR = "tests/faults"
OWN_FILES = ("tests/faults/REPORT.md", "tests/faults/REPORT.json")
#: What the fault tests judge: a change here after the report's commit is shown, not red.
PRODUCT_DIRS = ("admission", "dashboard", "schemas", "spendgate", "streams")


def _git(*args: str) -> str:
    """``git <args>`` in the repository root; its stdout (fails loudly without git)."""
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def provenance() -> dict[str, Any]:
    """The commit checked out now and the paths that differ from it (uncommitted)."""
    commit = _git("rev-parse", "HEAD").strip()
    changed = sorted(
        line[3:].split(" -> ")[-1]
        for line in _git("status", "--porcelain", "--untracked-files=all").splitlines()
        if line[3:].split(" -> ")[-1] not in OWN_FILES
    )
    return {"commit": commit, "dirty": bool(changed), "uncommitted": changed}


def changed_since(commit: str, *paths: str) -> list[str]:
    """Files under ``paths`` that differ now (committed since, or not committed) from
    ``commit``, untracked ones included; the report's own files left out."""
    tracked = _git("diff", "--name-only", commit, "--", *paths).splitlines()
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", *paths).splitlines()
    return sorted({p for p in tracked + untracked if p and p not in OWN_FILES})


SCENARIOS: dict[str, tuple[str, str]] = {
    "1": ("Worker crash", "SIGKILL the worker mid-stream (twice, at two moments), restart: "
          "windows equal the exact ledger."),
    "2": ("Broker restart during load", "Kafka killed and restarted under admission load: "
          "decisions from Redis, bounded buffer, closed refuses only when full; every "
          "published reservation counted once."),
    "3": ("Redis loss during load", "Redis stopped and restarted empty (and flushed): "
          "failure modes per policy; `spendgate replay` rebuilds the windows; a flush under "
          "200 racing admits admits nothing over the limit; a stopped worker's windows turn "
          "stale and the failure mode answers."),
    "4": ("Duplicate delivery", "The same records delivered three times (idempotent and "
          "non-idempotent producers), same-id records with other bodies, repeated admits "
          "and commits: counted once."),
    "5": ("Malformed input", "Topic and HTTP: dead letter or 4xx with a reason, processing "
          "goes on, nothing else changes."),
    "6": ("Races", "500 concurrent admits over 3 real admission processes sharing one "
          "Redis: never over the limit."),
    "7": ("Isolation", "Tokens cannot read or charge other tenants; crafted subject values "
          "cannot reach another budget key."),
    "12": ("Accepted means durable", "Broker paused + kill -9 of admission + resume, and "
           "broker down 30 s under load: every settlement answered 202 is in the log, every "
           "503 retried by the client lands once; SIGTERM with Kafka paused lists exactly "
           "what was not acked."),
    "13": ("Drift healed", "Redis windows altered behind the worker's back (doubled, "
           "trimmed, deleted) while other keys keep receiving events: healed within one "
           "drift cycle, counted, and no newer window overwritten."),
}  # fmt: skip

#: Figures shown in each scenario's summary table, when a test recorded them.
HEADLINE = [
    ("events_checked", "events / requests checked"),
    ("units_lost", "units lost"),
    ("units_double_counted", "units double-counted"),
    ("over_limit_units", "over-limit units"),
    ("cells_differing", "(key, bucket) cells differing"),
    ("accepted_missing_from_topic", "accepted events missing from the log"),
]

#: Root cause and suggested fix of each bug an xfail-strict test reproduces.
FIXES: dict[str, str] = {}

OBSERVATIONS = """\
- **Fixed after the first run of this suite** (their tests were xfail-strict and now pass):
  idempotency is scoped by tenant (scenario 7); `occurred_at` before 1970 is dead-lettered
  (scenario 5, pre-epoch test); dead letters carry at most the first 64 KiB of a record with
  its size and SHA-256, so oversized records are dead-lettered instead of lost (scenario 5,
  oversized test). After a flush, workers rewrite windows and policies from their tables
  (scenario 3, rewrite test); *until they have* (and have caught up with the records
  already in their partitions), the admission script finds the partitions' applied marks
  gone and answers from the failure mode with `state: missing` (scenario 3, flush and
  restart tests; issue 16 defect 2, which was xfail-strict here before the marks).
- **A huge negative `adjust`** still lands in its bucket (`SignedUsage` allows down to
  -(2**53-1)), but admission counts a negative window as 0: a refund cannot create room
  beyond the limit. A key's alerts and `budgets[].used` then show 0. (Not asserted here.)
- **Open admits past a full publish buffer reach the log late** (scenario 2): their
  reserve events are not queued, but each admit listed its reservation in Redis in the
  same atomic step, and the sweeper republishes it (same event id and bytes) once it is
  older than the grace period and Kafka answers; the test asserts every admitted
  reservation on the topic (`admitted_but_never_published` 0), counted once, nothing left
  pending. Before the sweeper they never reached the log.
- **A starting worker could overwrite fresher windows** (found by the changelog test): a
  new worker's first `keep_redis` tick rewrote every window from a snapshot taken before it
  awaited each write, so records applied meanwhile were overwritten by older state (5
  (key, bucket) cells wrong, 240 units lost and 233 double-counted, in 2 of 2 full-suite
  runs). Fixed: every window is written with its version (records applied to the key) and
  the rewrite is a compare-and-set that never replaces a newer window
  (`tests/integration/test_materialize.py::TestHealScript`). The changelog test still
  produces only after the new worker's mark is set.
- **Faust's committed offsets can stall after a kill** (scenario 1): after two SIGKILLs
  the group's committed offsets on the internal repartition topic stayed ~800 records
  behind for minutes, and after a restart on a wiped table folder once 140-573 records of
  `usage`, although every record had been applied (windows exact). This matches faust's
  gap-in-acks commit logic (faust-streaming issues #312, #606) and its skips during a
  rebalance (#216). Counting stays exact because every budget key applies each source
  position once, but the lag metric and a restart's re-reading grow. The crash test waits
  on `usage` alone and proves the rest by the windows; the batch fold (issue 11) is meant
  to take acks and offsets into its own hands.
- **A drift pass is one tick longer than `spendgate_drift_last_cycle_seconds` says**
  (scenario 13): the check takes `SPENDGATE_DRIFT_KEYS_PER_S` keys per 1 s tick and a pass
  ends on the tick that finds no key left, so 12 keys at 4/s are looked at again every 4 s
  while the metric (first tick to last) reports 3 s. The test bounds a heal by the 4 s.
- **False heals at start-up, intermittent** (scenario 13): in 1 of 5 runs on commit
  998ee92 the drift check healed 4 fresh windows 1 s after the worker started, while the
  test's first events were being applied (before anything was altered), and the test
  failed its precondition `nothing had drifted yet`. The windows then equalled what was
  sent, so nothing was lost; a window in flight looked like drift. Not fixed here.
- **Types on the topic**: `"input_tokens": "100"` and `true` are refused (dead-lettered);
  `5.0` is accepted as 5, as JSON Schema counts it an integer
  (`tests/schemas/test_claims.py`).
"""

MISSING = """\
- Scenario 1 measures loss and double counting in *units per (budget key, bucket)* against
  the exact ledger; it does not trace individual event ids through the worker (a unit
  difference of zero in every cell is the claim checked). Reservation expiry by time is
  not exercised (the workload's reservations are settled or abandoned inside one window).
- Scenario 2 restarts the broker under *admission* load only; the worker is not killed at
  the same time, and only a broker SIGKILL (not a clean stop, a network partition or a
  slow broker) is injected.
- Scenario 3 kills Redis and restarts it empty, or flushes it; a Redis restart *with*
  persistence (RDB/AOF reload of stale windows), the staleness bound (`state: stale`) and
  pending reservations lost with Redis are not tried. The marker rewrite is tested with one
  worker; the timing claim checked is "within 10 s", not "within a second".
- Scenario 4 repeats records within seconds; duplicates older than the dedupe horizon
  (24 h by default) and dedupe state after a restart at that age are not tried.
- Scenario 6 uses one Redis server, not Redis Cluster, and one bucket width per policy;
  the slot-by-slot compensation across shards (racing requests, a later shard refusing, a
  crash between shards released by the sweeper, a master killed under load) is tested on
  a real cluster in `tests/integration/test_cluster_admission.py`, not as a fault scenario.
- Nothing here runs the worker with more than one process during a fault (rebalances under
  faults are covered only by `tests/integration/test_worker_scale.py`), and every process
  runs on one machine over loopback (no latency or partition injection, no clock skew
  between admission hosts).
"""


def _junit(path: Path) -> dict[str, dict[str, Any]]:
    """nodeid -> {outcome, seconds, message} from pytest's JUnit XML."""
    out: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # tests.faults.test_x.TestY -> tests/faults/test_x.py::TestY::name
        module_end = next(i for i, p in enumerate(parts) if p.startswith("test_")) + 1
        nodeid = "/".join(parts[:module_end]) + ".py::" + "::".join([*parts[module_end:], name])
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "FAILED", (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfail (known bug)" if "xfail" in kind else "SKIPPED"
                message = child.get("message") or ""
        out[nodeid] = {
            "outcome": outcome,
            "seconds": float(case.get("time", 0)),
            "message": message,
        }
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) or "—"
    if isinstance(value, list):
        return "; ".join(_fmt(v) for v in value) if value else "none"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _test_name(nodeid: str) -> str:
    return nodeid.split("::")[-1].removeprefix("test_").replace("_", " ")


def environment() -> dict[str, str]:
    """What the header reports about the run's environment."""
    return {
        "python": platform.python_version(),
        "ci": os.environ.get("CI", "unset"),
        "kafka": os.environ.get("SPENDGATE_KAFKA_BOOTSTRAP", "from tests/fixtures/services"),
        "redis": os.environ.get("SPENDGATE_REDIS_URL", "from tests/fixtures/services"),
        "seed": os.environ.get(SEED_ENV, "unset"),
    }


def render(
    records: list[dict[str, Any]],
    results: dict[str, dict[str, Any]],
    *,
    seconds: float,
    exit_code: int,
    pytest_args: list[str],
    generated: str,
    env: dict[str, str],
    source: dict[str, Any] | None = None,
) -> str:
    """The REPORT.md text: a pure function of its arguments (REPORT.json keeps them)."""
    now = generated
    outcomes: dict[str, int] = {}
    for r in results.values():
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    lines = [
        "# Fault and abuse suite: observed figures",
        "",
        f"Generated {now} by `{COMMAND}"
        + (f" {shlex.join(pytest_args)}" if pytest_args else "")
        + "` (it runs `pytest tests/faults` and renders the figures each test recorded).",
        "",
        _source_line(source),
        f"- Suite run time: **{seconds:.0f} s**; pytest exit status {exit_code}; "
        + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())),
        f"- Python {env['python']}, CI={env['ci']}; shared Kafka `{env['kafka']}`, Redis "
        f"`{env['redis']}` (own topic and key prefixes per test; scenarios 2 and 3 start "
        "their own servers)",
        f"- Random inputs from seed **{env['seed']}**: `{SEED_ENV}={env['seed']} {COMMAND}` "
        "draws the same workloads and examples again.",
        "- Every figure below is asserted by its test against what the test itself sent or "
        "was told was accepted (a figure is shown only if its test checks it).",
        "- Tests marked *xfail (known bug)* reproduce a product bug and pass only while the "
        "bug is there (`xfail_strict`); see **Known bugs** below.",
        "",
    ]
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_scenario.setdefault(str(rec["scenario"]), []).append(rec)
    known_bugs: list[tuple[str, str, dict[str, Any]]] = []
    for number, (title, claim) in SCENARIOS.items():
        lines += [f"## {number}. {title}", "", claim, ""]
        recs = sorted(by_scenario.get(number, []), key=lambda r: r["test"])
        if not recs:
            lines += ["**Not run** (no figures recorded in this run).", ""]
            continue
        lines += [
            "| test | outcome | s | " + " | ".join(h for _, h in HEADLINE) + " |",
            "|---|---|---|" + "---|" * len(HEADLINE),
        ]
        for rec in recs:
            res = results.get(rec["test"], {"outcome": "not reported", "seconds": 0})
            cells = [_fmt(rec["figures"].get(k, "—")) for k, _ in HEADLINE]
            lines.append(
                f"| {_test_name(rec['test'])} | {res['outcome']} | {float(res['seconds']):.0f} | "
                + " | ".join(cells)
                + " |"
            )
            if res["outcome"].startswith("xfail"):
                known_bugs.append((rec["test"], res.get("message", ""), rec["figures"]))
        lines.append("")
        for rec in recs:
            lines += [f"**{_test_name(rec['test'])}** (`{rec['test']}`)", ""]
            if rec["faults"]:
                lines += ["- Faults injected:"] + [f"  - {f}" for f in rec["faults"]]
            shown = {k: v for k, v in rec["figures"].items() if k != "seconds"}
            if shown:
                lines += ["- Observed:"] + [f"  - `{k}`: {_fmt(v)}" for k, v in shown.items()]
            if rec["inputs"]:
                lines += [
                    f"- Inputs tried ({len(rec['inputs'])}):",
                    "  <details><summary>list</summary>",
                    "",
                ]
                lines += [f"  - {_fmt(i)}" for i in rec["inputs"]]
                lines += ["", "  </details>"]
            lines.append("")
    lines += ["## Known bugs (reproduced by xfail-strict tests)", ""]
    if not known_bugs:
        lines += ["None reproduced in this run.", ""]
    for nodeid, message, figures in known_bugs:
        shown = {k: v for k, v in figures.items() if k != "seconds"}
        lines += [
            f"- `{nodeid}`",
            f"  - {message.removeprefix('reason: ')}",
            f"  - observed: {_fmt(shown)}",
            f"  - cause and fix: {FIXES.get(nodeid.split('::')[-1], 'see the test')}",
            f"  - reproduce: `.venv/bin/python -m pytest '{nodeid}' --runxfail`",
        ]
    failed = [n for n, r in results.items() if r["outcome"] == "FAILED"]
    lines += ["", "## Failures in this run", ""]
    lines += [f"- `{n}`: {_fmt(results[n]['message'])}" for n in failed] or ["None.", ""]
    lines += ["", "## Other observations", "", OBSERVATIONS]
    lines += ["", "## Not covered", "", MISSING]
    return "\n".join(lines).rstrip() + "\n"


def _source_line(source: dict[str, Any] | None) -> str:
    """The header's provenance: the commit of the run and what was uncommitted then."""
    if not source:
        return "- Source: **unknown** (no commit recorded)"
    line = f"- Source: commit `{source['commit']}`"
    if not source["dirty"]:
        return line + ", clean checkout (no uncommitted changes)"
    files = ", ".join(f"`{f}`" for f in source["uncommitted"])
    return line + f", **dirty**: uncommitted changes in {files}"


def main(argv: list[str] | None = None) -> int:
    """Run the suite, write REPORT.md and REPORT.json, return pytest's exit status."""
    pytest_args = list(sys.argv[1:] if argv is None else argv)
    # One seed for the whole run, recorded in the report (reproduces its random inputs).
    os.environ.setdefault(SEED_ENV, str(random.SystemRandom().randrange(2**32)))
    source = provenance()  # before the run: what the tests ran from
    with tempfile.TemporaryDirectory(prefix="spendgate-faults-") as tmp:
        results_dir = Path(tmp) / "results"
        results_dir.mkdir()
        junit = Path(tmp) / "junit.xml"
        env = {**os.environ, "SPENDGATE_FAULTS_RESULTS": str(results_dir)}
        started = time.monotonic()
        code = subprocess.call(
            [sys.executable, "-m", "pytest", "tests/faults", "-p", "no:cacheprovider",
             f"--ignore={SELF_TEST}", f"--junitxml={junit}", "-o", "junit_family=xunit1",
             *pytest_args],
            cwd=ROOT,
            env=env,
        )  # fmt: skip
        seconds = time.monotonic() - started
        records = [json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))]
        inputs = {
            "records": records,
            "results": _junit(junit),
            "seconds": seconds,
            "exit_code": code,
            "pytest_args": pytest_args,
            "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ"),
            "env": environment(),
            "source": source,
        }
    INPUTS.write_text(json.dumps(inputs, indent=1, sort_keys=True, default=str) + "\n")
    REPORT.write_text(render_inputs(json.loads(INPUTS.read_text())))
    print(f"wrote {REPORT.relative_to(ROOT)} ({len(records)} records, {seconds:.0f} s)")
    return code


def render_inputs(inputs: dict[str, Any]) -> str:
    """``render`` of what ``REPORT.json`` holds."""
    return render(
        inputs["records"],
        inputs["results"],
        seconds=inputs["seconds"],
        exit_code=inputs["exit_code"],
        pytest_args=inputs["pytest_args"],
        generated=inputs["generated"],
        env=inputs["env"],
        source=inputs.get("source"),
    )


if __name__ == "__main__":
    sys.exit(main())
