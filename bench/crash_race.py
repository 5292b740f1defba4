"""Crash-race reproducer (issue 42): the two-SIGKILL scenario and variants, run many times.

Variants (``--variant``), each run in its own process with a fresh seed, one at a time:

* ``suite``: the fault suite's two-kill test itself (``tests/faults/test_worker_crash.py``)
  in a pytest process; its recorded figures are read back.
* ``twokill``: the same scenario driven here (the suite's workload with late, ancient and
  duplicate records; kill 1 once the first counts reach Redis, kill 2 past half of the
  ledger), with random extra delays before each kill, and the differing cells explained.
* ``catchup``: as ``twokill``, but kill 2 lands 0.5-3 s after the second worker joined
  the group, early in its catching up (large batches, changelog writes queued).
* ``restore``: as ``twokill``, but the second and third workers start on empty table
  folders (their tables come back from the changelog) and the second is killed during or
  right after its restore.
* ``rebalance``: as ``twokill``, with a helper worker (its own table folder) joining after
  kill 1, so partitions move between the kills, and kept running to the end.
* ``all``: the driven variants in turn; or a comma-separated list of variants, in turn.

Each kill is also measured: the usage records below the group's committed offset that the
table the next worker starts from has not applied, which it never reads again: in
``twokill`` and ``catchup`` the killed worker's folder as faust recovers it
(``unapplied_at_kills``), and in every driven variant a folder that is empty, the table
from the changelog alone (``fresh``).

Each run checks, once the group has read every usage record, that Redis holds the exact
ledger bucket for bucket (120 s at most). Nothing is written into the repository: the
workers' folders and logs go to a temporary folder (kept under ``--keep`` for failed runs).

Run: ``.venv/bin/python -m bench.crash_race --runs 30`` (``--help``). Prints one line per
run and a summary line with the failure rate; the exit status is 1 when a run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import _common as c

TEST = (
    "tests/faults/test_worker_crash.py::TestWorkerCrash::"
    "test_two_sigkills_at_different_moments_lose_nothing_and_count_nothing_twice"
)
VARIANTS = ("suite", "twokill", "catchup", "restore", "rebalance")
EVENTS = 6000


@dataclass
class Outcome:
    """One run: passed or not, and what its figures said."""

    run: int
    variant: str
    seed: int
    passed: bool
    seconds: float
    cells_differing: int | None = None
    units_lost: int | None = None
    units_double_counted: int | None = None
    tail: str = ""
    cells: list[dict[str, Any]] = field(default_factory=list)
    #: At each kill: records below the group's committed offset that the killed worker's
    #: table had not applied (the next worker never reads them again), with a sample.
    unapplied_at_kills: list[int] = field(default_factory=list)
    unapplied_sample: list[str] = field(default_factory=list)
    #: The same for a worker starting on an empty folder (its table from the changelog
    #: alone, as after a move to another machine or a wiped folder).
    unapplied_fresh_at_kills: list[int] = field(default_factory=list)

    @property
    def race(self) -> bool:
        """Whether the windows differed from the ledger at the end (the race, not a
        precondition that failed, e.g. a kill that did not land mid-stream)."""
        return bool(self.cells_differing)


# -- the suite's test, in pytest ----------------------------------------------------------


def run_suite(run: int, seed: int, timeout_s: float) -> Outcome:
    """Run the fault suite's test once in its own pytest process; read its figures."""
    with tempfile.TemporaryDirectory(prefix="crash-race-") as tmp:
        env = {
            **os.environ,
            "SPENDGATE_KAFKA_BOOTSTRAP": c.KAFKA,
            "SPENDGATE_REDIS_URL": c.REDIS,
            "SPENDGATE_TEST_SEED": str(seed),
            "SPENDGATE_FAULTS_RESULTS": str(Path(tmp) / "results"),
        }
        cmd = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            f"--basetemp={Path(tmp) / 'pytest'}", TEST,
        ]  # fmt: skip
        started = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=c.ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            passed, out = proc.returncode == 0, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            passed, out = False, f"timed out after {timeout_s:.0f} s: {exc.stdout!r}"
        seconds = time.monotonic() - started
        figures: dict[str, int] = {}
        for path in (Path(tmp) / "results").glob("*.json"):
            figures = json.loads(path.read_text()).get("figures", {})
    lines = [ln for ln in out.splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if "Error" in ln or "assert" in ln), "")
    return Outcome(
        run=run,
        variant="suite",
        seed=seed,
        passed=passed,
        seconds=seconds,
        cells_differing=figures.get("cells_differing"),
        units_lost=figures.get("units_lost"),
        units_double_counted=figures.get("units_double_counted"),
        tail=(tail or (lines[-1] if lines else ""))[:200],
    )


# -- the driven variants (a child process per run: the seed is read at import) -------------


def run_driven(run: int, variant: str, seed: int, timeout_s: float, keep: Path | None) -> Outcome:
    """Run one driven variant in a child process (``--one``) and read its JSON line."""
    env = {**os.environ, "SPENDGATE_TEST_SEED": str(seed)}
    cmd = [sys.executable, "-m", "bench.crash_race", "--one", variant]
    if keep is not None:
        cmd += ["--keep", str(keep)]
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=c.ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = f"timed out after {timeout_s:.0f} s: {exc.stdout!r}"
    seconds = time.monotonic() - started
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            raw = json.loads(line)
            raw.update(run=run, seconds=seconds)
            return Outcome(**raw)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return Outcome(run, variant, seed, False, seconds, tail=" ".join(lines[-3:])[:300])


def one(variant: str, keep: Path | None) -> int:
    """The child: one driven run; prints its outcome as a JSON line."""
    from tests.fixtures import seeds

    tmp = Path(tempfile.mkdtemp(prefix="crash-race-"))
    outcome = Outcome(0, variant, seeds.RUN_SEED, False, 0.0)
    try:
        asyncio.run(_drive(variant, tmp, outcome))
    except Exception as exc:  # noqa: BLE001 - reported as the run's failure
        outcome.tail = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if not outcome.passed and keep is not None:
            dest = keep / f"{variant}-{outcome.seed}"
            shutil.copytree(tmp, dest, dirs_exist_ok=True, ignore=_only_logs)
            outcome.tail += f" (logs in {dest})"
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(asdict(outcome)), flush=True)
    return 0


def _only_logs(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(("tables", "helper"))]


async def _drive(variant: str, tmp: Path, outcome: Outcome) -> None:
    import redis

    from spendgate.schemas.policies import Policy
    from spendgate.streams.settings import WorkerSettings
    from spendgate.streams.topics import ensure_topics
    from tests.faults.conftest import all_windows, compare
    from tests.fixtures import seeds
    from tests.fixtures.consumption import wait_consumed
    from tests.fixtures.kafka_io import produce
    from tests.fixtures.pipeline import Workers, apply_and_wait
    from tests.fixtures.workload import generate

    rng = seeds.rng(f"crash-race:{variant}")
    name = f"cr{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(
        kafka_bootstrap=c.KAFKA,
        redis_url=c.REDIS,
        topic_prefix=f"{name}.",
        redis_prefix=f"{name}:",
        app_id=f"{name}.app",
        data_dir=tmp / "tables",
        metrics_port=0,
        partitions=2,
    )
    await ensure_topics(settings)
    workers = Workers.__new__(Workers)  # its __init__ runs its own event loop
    workers.settings, workers.logs, workers.procs = settings, tmp, []
    client = redis.Redis.from_url(c.REDIS)
    policy = Policy.model_validate(
        {
            "id": f"p-{uuid.uuid4().hex[:8]}",
            "unit": "input_tokens",
            "limit": 10**12,
            "window": "1h",
            "bucket": "1m",
            "group_by": ["tenant"],
        }
    )
    work = generate(policy, EVENTS, now_ms=int(time.time() * 1000), seed="worker-crash")
    prefix, usage = settings.redis_prefix, settings.topic("usage")
    half = len(work.records) // 2

    def held() -> int:
        return compare(client, prefix, work.expected).units_held

    async def progress(above: int) -> int:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (have := held()) > above:
                return have
            await asyncio.sleep(0.05)
        raise AssertionError(f"no progress beyond {above} units in 120 s")

    async def kill(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        stem = f"{policy.id}|tenant="
        if variant in ("twokill", "catchup"):
            # The next worker starts on the same folder and resumes at the group's commit:
            # what that folder's table lacks below the commit is never read again.
            n, sample = await unapplied(settings, stem, tmp / "tables")
            outcome.unapplied_at_kills.append(n)
            outcome.unapplied_sample += sample
        # A worker on an empty folder: its table is the changelog alone.
        n, sample = await unapplied(settings, stem, None)
        outcome.unapplied_fresh_at_kills.append(n)
        outcome.unapplied_sample += sample

    async def joined(name: str, times: int = 1) -> None:
        """Wait until worker ``name`` joined the group ``times`` times (its log says so)."""
        deadline = time.monotonic() + 90
        log = tmp / f"worker-{name}.log"
        while time.monotonic() < deadline:
            if log.exists() and log.read_bytes().count(b"Joined group") >= times:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"worker {name} did not join the group {times} times in 90 s")

    try:
        first = workers.start("first")
        await apply_and_wait(settings, client, policy)
        await produce(settings.kafka_bootstrap, usage, work.records[:half])
        seen = await progress(0)
        await asyncio.sleep(rng.uniform(0, 1.5))  # the kill's moment varies
        await kill(first)
        if variant == "rebalance":
            workers.start("helper", data_dir=tmp / "helper-tables")
        second_dir = tmp / "tables-second" if variant == "restore" else None
        second = workers.start("second", data_dir=second_dir)
        await produce(settings.kafka_bootstrap, usage, work.records[half:])
        if variant == "restore":
            # During or right after its restore from the changelog.
            await joined("second")
            await asyncio.sleep(rng.uniform(0.0, 4.0))
        elif variant == "catchup":
            # Early in its catching up, batches large and changelog writes queued.
            await joined("second")
            await asyncio.sleep(rng.uniform(0.5, 3.0))
        else:
            ledger = sum(sum(b.values()) for b in work.expected.values())
            await progress(max(seen, ledger // 2))
            await asyncio.sleep(rng.uniform(0, 1.5))
        await kill(second)
        third_dir = tmp / "tables-third" if variant == "restore" else None
        workers.start("third", data_dir=third_dir)
        await wait_consumed(
            settings.kafka_bootstrap, settings.app_id, usage, timeout_s=240, source_only=True
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if compare(client, prefix, work.expected).exact:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)
        final = compare(client, prefix, work.expected)
        outcome.passed = final.exact
        outcome.cells_differing = final.cells_differing
        outcome.units_lost = final.units_lost
        outcome.units_double_counted = final.units_double_counted
        if not final.exact:
            outcome.cells = _explain(all_windows(client, prefix), work)
    finally:
        workers.stop_all()
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
        client.close()


async def unapplied(settings: Any, key_stem: str, data_dir: Path | None) -> tuple[int, list[str]]:
    """The usage records below the group's committed offset that the table the next worker
    starts from has not applied: a worker started on ``data_dir`` (a killed worker's
    folder) resumes at the committed offset (or at the table's own applied position when
    that is earlier, once the table keeps one) and never reads them again.

    That table is what faust's recovery makes of the folder: each partition's database,
    then the changelog replayed over it from the offset the database last persisted (on
    the ack of a changelog write) to the end. Producer duplicates (an event id seen before
    in the partition) are left out: they change no key, so no key's offset shows them.
    """
    from rocksdict import AccessType, Options, Rdict

    from spendgate.streams.ledger import KeyState
    from tests.fixtures.consumption import committed
    from tests.fixtures.kafka_io import read_records

    usage = settings.topic("usage")
    done = {tp.partition: o for tp, o in (await committed(settings.kafka_bootstrap,
                                                           settings.app_id)).items()
            if tp.topic == usage}  # fmt: skip
    changelog = f"{settings.app_id}-keystate-changelog"
    logged: dict[int, list[Any]] = {}
    for rec in await read_records(settings.kafka_bootstrap, changelog):
        logged.setdefault(rec.partition, []).append(rec)
    values: dict[bytes, bytes | None] = {}
    folder = None if data_dir is None else data_dir / "v1" / "tables"
    for partition in sorted(set(logged) - _partitions_in(folder)):
        for rec in logged[partition]:  # no database: the whole changelog
            if rec.key is not None:
                values[rec.key] = rec.value
    for db_path in sorted(folder.glob("keystate-*.db")) if folder is not None else []:
        partition = int(db_path.stem.rsplit("-", 1)[1])
        db = Rdict(str(db_path), Options(raw_mode=True), access_type=AccessType.read_only())
        try:
            persisted = db.get(b"__faust\0offset__")
            values.update((k, v) for k, v in db.items() if isinstance(k, bytes))
        finally:
            db.close()
        since = int(persisted) if persisted is not None else 0
        for rec in logged.get(partition, []):
            if rec.offset >= since and rec.key is not None:
                values[rec.key] = rec.value
    states = {
        json.loads(k): KeyState.from_bytes(v)
        for k, v in values.items()
        if v is not None and k.startswith(b'"' + key_stem.encode())
    }
    # A worker that keeps the last offset its table applied (streams.gaps) resumes at the
    # earlier of that and the commit.
    for partition in list(done):
        applied = values.get(json.dumps(f"~applied|{usage}|{partition}").encode())
        if applied:
            done[partition] = min(done[partition], int(applied) + 1)
    seen: set[tuple[int, str]] = set()
    missing: list[str] = []
    for rec in await read_records(settings.kafka_bootstrap, usage):
        body = json.loads(rec.value or b"{}")
        first_copy = (rec.partition, body["event_id"]) not in seen
        seen.add((rec.partition, body["event_id"]))
        if not first_copy or rec.offset >= done.get(rec.partition, 0):
            continue
        state = states.get(key_stem + body["subject"]["tenant"])
        if state is None or state.offsets.get(rec.partition, -1) < rec.offset:
            missing.append(
                f"p{rec.partition}@{rec.offset} {body['kind']} {body.get('reservation_id') or ''}"
                f" committed={done.get(rec.partition)} key offset="
                f"{None if state is None else state.offsets.get(rec.partition)}"
            )
    return len(missing), missing[:5]


def _partitions_in(folder: Path | None) -> set[int]:
    """The table partitions with a database in ``folder``."""
    if folder is None:
        return set()
    return {int(p.stem.rsplit("-", 1)[1]) for p in folder.glob("keystate-*.db")}


def _explain(held: dict[str, dict[int, int]], work: Any) -> list[dict[str, Any]]:
    """Each differing cell, with the records of its key whose effect is the difference."""
    out = []
    for key in sorted(set(work.expected) | set(held)):
        want, have = work.expected.get(key, {}), held.get(key, {})
        for bucket in sorted(set(want) | set(have)):
            w, h = want.get(bucket, 0), have.get(bucket, 0)
            if w == h:
                continue
            diff = h - w
            suspects = []
            for i, ((_, value), effects) in enumerate(zip(work.records, work.effects, strict=True)):
                body = json.loads(value)
                if f"tenant={body['subject']['tenant']}" not in key:
                    continue
                amounts = {a for _, _, a in effects} | {
                    (body.get("usage") or {}).get("input_tokens")
                }
                if abs(diff) in amounts or -abs(diff) in amounts:
                    suspects.append(
                        f"#{i} {body['kind']} {body.get('reservation_id') or ''} "
                        f"{body['occurred_at'][11:19]} {body.get('usage')} {effects}"
                    )
            out.append({"key": key, "bucket": bucket, "want": w, "have": h, "suspects": suspects})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.crash_race", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="how many runs, one at a time")
    ap.add_argument(
        "--variant",
        default="suite",
        help=f"which scenario: one of {', '.join(VARIANTS)}, all (the driven ones), or a "
        "comma-separated list run in turn (default: suite, the fault suite's test itself)",
    )
    ap.add_argument("--seed", type=int, default=None, help="the first run's seed (then +1 per run)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per run at most")
    ap.add_argument(
        "--keep", type=Path, default=None, help="copy a failed driven run's worker logs here"
    )
    ap.add_argument("--one", choices=VARIANTS[1:], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one, args.keep)
    first = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    cycle = VARIANTS[1:] if args.variant == "all" else tuple(args.variant.split(","))
    if unknown := set(cycle) - set(VARIANTS):
        ap.error(f"unknown variant(s): {', '.join(sorted(unknown))}")
    outcomes: list[Outcome] = []
    started = time.monotonic()
    for i in range(args.runs):
        variant, seed = cycle[i % len(cycle)], first + i
        if variant == "suite":
            o = run_suite(i + 1, seed, args.timeout)
        else:
            o = run_driven(i + 1, variant, seed, args.timeout, args.keep)
        outcomes.append(o)
        verdict = "pass" if o.passed else ("RACE" if o.race else "fail")
        print(
            f"run {o.run}/{args.runs} {o.variant} seed={o.seed} {verdict} {o.seconds:.0f}s "
            f"cells_differing={o.cells_differing} lost={o.units_lost} "
            f"double={o.units_double_counted} unapplied_at_kills={o.unapplied_at_kills} "
            f"fresh={o.unapplied_fresh_at_kills}" + ("" if o.passed else f" | {o.tail}"),
            flush=True,
        )
        if any(o.unapplied_at_kills) or any(o.unapplied_fresh_at_kills):
            print(f"    unapplied below the committed offset at the kills: "
                  f"{o.unapplied_at_kills} {o.unapplied_sample}", flush=True)  # fmt: skip
        for cell in o.cells:
            print(f"    {json.dumps(cell)}", flush=True)
    races = sum(o.race for o in outcomes)
    other = sum(not o.passed and not o.race for o in outcomes)
    total = time.monotonic() - started
    print(
        f"summary: {races} of {len(outcomes)} runs ended with cells differing from the ledger "
        f"({100 * races / max(1, len(outcomes)):.1f}%), {other} failed otherwise, "
        f"{total:.0f} s in all ({', '.join(sorted(set(cycle)))})",
        flush=True,
    )
    return 1 if races or other else 0


if __name__ == "__main__":
    sys.exit(main())
