"""Stall reproducer (issue 52, "The worker never hangs"): how often a fresh worker stops
applying under load on a three-broker SASL_SSL Kafka (or a one-broker plaintext one).

Each run, one at a time, on one Kafka cluster kept up across the series (``spendgate
dev up --brokers 3 --security sasl_ssl``'s ``LocalKafkaCluster``, or one plaintext broker)
and one private redis-server:

1. a fresh worker and two admission processes on topics and keys of their own
   (``tests/fixtures/load_stack.py``'s ``start_stack``), the run's policies published
   (roomy limits: every admit is admitted);
2. the load starts as soon as the worker's ``/readyz`` answers 200 and both admission
   processes vouch for every budget: ``--rate`` admits/s (20) over both, each admitted
   reservation committed or released, for ``--seconds`` (60);
3. ``--kill-at`` (20) s into the load, ``kill -9`` of the broker leading a partition of
   ``usage`` and of the worker's changelog (both when one broker leads both), started
   again as a supervisor would once its partitions are led elsewhere;
4. a watch, all along (every 0.5 s or so): the worker's applied progress (``/metrics``'
   ``spendgate_consumer_offset``, the last usage offset applied per partition) compared
   with the ``usage`` topic's end offsets, and admission's ``/v1/status``. A partition
   whose records wait and whose applied offset has not moved for ``--stall-s`` (15), or
   ``/v1/status`` undecidable that long, is a stall (``--fault-stall-s`` (45) for a
   pause that began after the kill: a killed leader legitimately holds the worker up for
   a while). On a stall, before anything is stopped: ``py-spy dump --locals`` of the
   worker, its ``/readyz``, ``/healthz`` and ``/metrics``, ``kill -USR1`` (the worker logs
   every asyncio task's stack) and a copy of its log, in ``<out>.evidence/<stack>-<run>/``;
5. the load stopped (undecided admits asked again, reservations settled), the windows in
   Redis compared with the load's exact ledger (waiting for them, unless stalled), the
   worker's ``spendgate_worker_bound_hits_total`` and ``spendgate_worker_resends_total``
   read (null when absent), then SIGTERM and the time it took to exit (``kill -9`` after
   45 s), and ``spendgate replay --verify`` on the run's topics and keys.

Each run appends one JSON line to ``--out`` (an interrupted series keeps what it did;
run numbers go on from the lines already there for the same stack). Ports: Kafka clients
31400-31402, controllers 31500-31502 (with SASL_SSL the brokers replicate on
31600-31602); Redis, the worker and admission on free ephemeral ports; loopback only.

Run from a checkout with its venv (py-spy installed in it):
``.venv/bin/python -m bench.stall_repro --stack sasl_ssl3 --runs 30 --budget-min 80
--out /work/stall-results/sasl_ssl3.jsonl`` (``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis
from aiokafka import TopicPartition

from spendgate.devkafka import KafkaClusterSettings, LocalKafkaCluster
from spendgate.devstack import port_open
from spendgate.schemas import kafka_connect
from tests.fixtures.admission import REDIS_SERVER, OwnRedis
from tests.fixtures.load_stack import Load, Stack, crash, open_load, ready, start_stack
from tests.fixtures.pipeline import settings_env

STACKS = {"sasl_ssl3": (3, "sasl_ssl"), "plaintext1": (1, "plaintext")}
#: Node 1's client port (controllers at +100, SASL_SSL replication at +200).
CLUSTER_PORT = 31400
#: Limits no load meets: every admit is admitted and then committed or released.
ROOMY = 10**8
#: Counters the fix of issue 52 adds to the worker's /metrics (null in a line without).
FIX_COUNTERS = ("spendgate_worker_bound_hits_total", "spendgate_worker_resends_total")
#: How long a SIGTERMed worker is given before kill -9.
TERM_GRACE_S = 45.0
#: How often the watch samples the worker, Kafka and admission.
WATCH_EVERY_S = 0.5


# --- small helpers ----------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, list[tuple[str, float]]]:
    """Prometheus text as ``name -> [(labels, value)]`` (comments skipped)."""
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m is None:
            continue
        with contextlib.suppress(ValueError):
            out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return out


def metric_sum(parsed: dict[str, list[tuple[str, float]]], name: str) -> float | None:
    """A metric summed over its labels; None when the worker does not have it."""
    samples = parsed.get(name)
    return None if samples is None else sum(v for _, v in samples)


def usage_offsets(parsed: dict[str, list[tuple[str, float]]], topic: str) -> dict[int, int]:
    """``spendgate_consumer_offset`` of ``topic``: the last offset applied per partition."""
    out = {}
    for labels, value in parsed.get("spendgate_consumer_offset", []):
        if f'topic="{topic}"' in labels:
            m = re.search(r'partition="(\d+)"', labels)
            if m:
                out[int(m.group(1))] = int(value)
    return out


def git_sha(cwd: Path) -> str:
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or "unknown"


def previous_runs(out: Path, stack: str) -> int:
    """How many lines of ``stack`` the results file holds already."""
    if not out.exists():
        return 0
    count = 0
    for line in out.read_text().splitlines():
        with contextlib.suppress(ValueError):
            if json.loads(line).get("stack") == stack:
                count += 1
    return count


async def get(http: httpx.AsyncClient, url: str, timeout_s: float = 2.0) -> httpx.Response | None:
    try:
        return await http.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None


def say(line: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {line}", flush=True)


# --- the cluster ------------------------------------------------------------------------------


@dataclass
class Cluster:
    """The Kafka cluster of the series."""

    kafka: LocalKafkaCluster
    security: str

    def env(self) -> dict[str, str]:
        """``SPENDGATE_KAFKA_*`` as ``spendgate dev env`` prints them."""
        env = {}
        for line in self.kafka.env_lines():
            name, _, value = shlex.split(line.removeprefix("export "))[0].partition("=")
            env[name] = value
        return env

    def kill(self, node: int) -> None:
        pid = self.kafka.pid(node)
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        child = self.kafka._children.get(node)
        if child is not None:  # reaped: the restart replaces the handle
            child.wait(timeout=10)

    def wait_ports_free(self, timeout_s: float) -> None:
        """Wait (bounded) until no port of the cluster answers: a node just killed may hold
        its listeners a moment."""
        kafka = self.kafka
        ports = [kafka.port(n) for n in kafka.node_ids]
        ports += [kafka.controller_port(n) for n in kafka.node_ids]
        if self.security == "sasl_ssl":
            ports += [kafka.replication_port(n) for n in kafka.node_ids]
        deadline = time.monotonic() + timeout_s
        while (taken := [p for p in ports if port_open(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        if taken:
            say(f"ports still answering after {timeout_s} s: {taken}")

    def stop(self) -> None:
        """Every node killed (state thrown away with the series), then the pid files."""
        for node in self.kafka.node_ids:
            if (pid := self.kafka.pid(node)) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.kafka.down()


async def describe(
    stack: Stack, cluster: Cluster, topics: list[str], nodes: list[int] | None = None
) -> list[tuple[str, int, int]]:
    """(topic, partition, leader) of ``topics`` as the brokers ``nodes`` (default all)
    describe them; [] when none answers in time."""
    kafka = cluster.kafka
    bootstrap = ",".join(f"127.0.0.1:{kafka.port(n)}" for n in nodes or kafka.node_ids)
    admin = kafka_connect.admin(
        stack.settings.kafka().model_copy(update={"bootstrap": bootstrap}),
        request_timeout_ms=3000,
    )
    try:
        await asyncio.wait_for(admin.start(), 5)
        present = set(await asyncio.wait_for(admin.list_topics(), 5))
        wanted = [t for t in topics if t in present]
        described = await asyncio.wait_for(admin.describe_topics(wanted), 5) if wanted else []
    except Exception:  # noqa: BLE001 - not answering (yet): asked again
        return []
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(admin.close(), 5)
    return sorted(
        (t["topic"], p["partition"], p["leader"]) for t in described for p in t["partitions"]
    )


# --- one run ----------------------------------------------------------------------------------


@dataclass
class Watch:
    """What the watch saw of the worker's progress (monotonic times)."""

    load_started: float
    stall_s: float
    fault_stall_s: float
    killed: float | None = None
    #: spendgate_events_total and spendgate_keyed_records_total, last read.
    counted: tuple[float | None, float | None] = (None, None)
    #: Per usage partition: when its applied offset last moved (or nothing of it waited).
    moved: dict[int, float] = field(default_factory=dict)
    #: The earliest of those among partitions whose records wait.
    last_progress: float = 0.0
    waiting: bool = False
    end_offsets: dict[int, int] = field(default_factory=dict)
    applied: dict[int, int] = field(default_factory=dict)
    max_gap_s: float = 0.0
    max_gap_began_s: float | None = None
    undecidable_since: float | None = None
    max_undecidable_s: float = 0.0
    last_metrics: str = ""
    stall: dict[str, Any] | None = None
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    samples: int = 0
    status_errors: int = 0

    def at(self, t: float) -> float:
        return round(t - self.load_started, 2)

    def limit(self, began: float) -> float:
        """The stall threshold of a pause that began at ``began``."""
        return self.stall_s if self.killed is None or began < self.killed else self.fault_stall_s


async def watch(
    w: Watch,
    stack: Stack,
    http: httpx.AsyncClient,
    evidence: Path,
    until: float,
) -> None:
    """Sample the worker until ``until`` (monotonic) or a stall (evidence taken at once)."""
    usage = stack.settings.topic("usage")
    metrics_url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    consumer = kafka_connect.consumer(stack.settings.kafka(), request_timeout_ms=5000)
    started = False
    tps = [TopicPartition(usage, p) for p in range(stack.settings.partitions)]
    w.last_progress = time.monotonic()
    seen: dict[int, int] = {}
    last_ends = 0.0
    try:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(consumer.start(), 10)
            started = True
        while time.monotonic() < until and w.stall is None:
            now = time.monotonic()
            w.samples += 1
            reply = await get(http, metrics_url)
            if reply is not None and reply.status_code == 200:
                w.last_metrics = reply.text
                parsed = parse_metrics(reply.text)
                w.applied = usage_offsets(parsed, usage)
                w.counted = (
                    metric_sum(parsed, "spendgate_events_total"),
                    metric_sum(parsed, "spendgate_keyed_records_total"),
                )
            if started and now - last_ends >= 1.0:
                last_ends = now
                with contextlib.suppress(Exception):
                    ends = await asyncio.wait_for(consumer.end_offsets(tps), 5)
                    w.end_offsets = {tp.partition: int(o) for tp, o in ends.items()}
            # Per partition: its applied offset moved, or nothing of it waits (no pause).
            waiting = []
            for p in range(stack.settings.partitions):
                applied = w.applied.get(p, -1)
                if applied != seen.get(p) or w.end_offsets.get(p, 0) - 1 <= applied:
                    w.moved[p] = now
                else:
                    waiting.append(p)
                seen[p] = applied
            w.waiting = bool(waiting)
            w.last_progress = min((w.moved[p] for p in waiting), default=now)
            gap = now - w.last_progress
            if gap > w.max_gap_s:
                w.max_gap_s, w.max_gap_began_s = round(gap, 2), w.at(w.last_progress)
            status = await get(http, f"{stack.urls[0]}/v1/status")
            decidable: bool | None = None
            if status is not None and status.status_code == 200:
                with contextlib.suppress(ValueError):
                    decidable = bool(status.json().get("decidable"))
            else:
                w.status_errors += 1
            if decidable is False:
                if w.undecidable_since is None:
                    w.undecidable_since = now
                w.max_undecidable_s = max(w.max_undecidable_s, round(now - w.undecidable_since, 2))
            elif decidable:
                w.undecidable_since = None
            kind = None
            if w.waiting and gap >= w.limit(w.last_progress):
                kind, began = "no_progress", w.last_progress
            elif w.undecidable_since is not None and now - w.undecidable_since >= w.limit(
                w.undecidable_since
            ):
                kind, began = "undecidable", w.undecidable_since
            if kind is not None:
                w.stall = {
                    "kind": kind,
                    "at_s": w.at(began),
                    "detected_at_s": w.at(now),
                    "after_kill": w.killed is not None and began >= w.killed,
                    "applied_offsets": w.applied,
                    "end_offsets": w.end_offsets,
                }
                say(f"  STALL ({kind}) since {w.at(began)} s into the load: taking evidence")
                await take_evidence(stack, http, evidence, w)
                w.stalled.set()
                return
            await asyncio.sleep(WATCH_EVERY_S)
    finally:
        if started:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), 10)


async def take_evidence(stack: Stack, http: httpx.AsyncClient, out: Path, w: Watch) -> None:
    """The stalled worker as it is, before anything stops it."""
    pid = stack.worker.pid
    base = f"http://127.0.0.1:{stack.metrics_port}"
    files: dict[str, str] = {}
    for name, url in (
        ("readyz.json", f"{base}/readyz"),
        ("healthz.json", f"{base}/healthz"),
        ("metrics.txt", f"{base}/metrics"),
        ("status.json", f"{stack.urls[0]}/v1/status"),
    ):
        reply = await get(http, url, 5)
        files[name] = "no answer" if reply is None else f"{reply.status_code}\n{reply.text}"
    files["watch.json"] = json.dumps(
        {k: v for k, v in w.__dict__.items() if k not in ("stalled", "last_metrics")},
        indent=1,
        default=str,
    )
    files |= await asyncio.to_thread(py_spy, pid)
    await asyncio.to_thread(write_files, out, files)
    log = stack.logs / "worker-w1.log"
    mark = await asyncio.to_thread(lambda: log.stat().st_size if log.exists() else 0)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGUSR1)
    await asyncio.sleep(3.0)
    await asyncio.to_thread(copy_logs, stack, out, mark)


def py_spy(pid: int) -> dict[str, str]:
    """``py-spy dump`` of ``pid``, with and without locals."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return {"py-spy.txt": "py-spy not found: pip install py-spy"}
    out = {}
    for name, extra in (("py-spy-locals.txt", ["--locals"]), ("py-spy.txt", [])):
        try:
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid), *extra],
                capture_output=True,
                text=True,
                timeout=90,
                check=False,
            )
            out[name] = done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            out[name] = "py-spy timed out after 90 s"
    return out


def write_files(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def copy_logs(stack: Stack, out: Path, mark: int) -> None:
    """The worker's log (whole, its tail, and what it wrote since ``mark``: the task
    stacks SIGUSR1 asked for) and the admission processes' logs."""
    log = stack.logs / "worker-w1.log"
    if log.exists():
        shutil.copy(log, out / "worker.log")
        with open(log, "rb") as f:
            f.seek(mark)
            (out / "worker-tasks.log").write_bytes(f.read())
        lines = log.read_text(errors="replace").splitlines()
        (out / "worker-tail.log").write_text("\n".join(lines[-400:]) + "\n")
    for path in stack.logs.glob("admission-*.log"):
        shutil.copy(path, out / path.name)


async def paced_admitter(
    load: Load, url: str, stop: asyncio.Event, interval_s: float, until: float
) -> None:
    """Admits on ``url`` every ``interval_s`` (no burst to catch up) until ``stop``."""
    next_at = time.monotonic()
    while not stop.is_set() and time.monotonic() < until:
        tenant = load.rng.choices(load.tenants, (4, 3, 2, 1))[0]
        await load.admit(url, uuid.uuid4().hex, tenant, load.rng.randint(1, 4))
        next_at = max(next_at + interval_s, time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))


async def bounded(awaitable: Awaitable[Any], timeout_s: float, what: str, errors: list[str]) -> Any:
    """``awaitable`` within ``timeout_s``; a failure noted in ``errors``, not raised."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except (TimeoutError, AssertionError, Exception) as exc:  # noqa: BLE001
        errors.append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
        return None


async def until_stalled(stalled: asyncio.Event, coro: Awaitable[Any]) -> bool:
    """Run ``coro`` unless the watch finds a stall first; whether it completed."""
    task = asyncio.ensure_future(coro)
    stop = asyncio.ensure_future(stalled.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return False


@dataclass
class Fault:
    """The kill of a leading broker and its restart."""

    victim: int | None = None
    led: list[str] = field(default_factory=list)
    killed_at_s: float | None = None
    moved_after_s: float | None = None
    restart_s: float | None = None
    error: str = ""


async def fault(
    cluster: Cluster, stack: Stack, w: Watch, kill_at: float, f: Fault, restarted: asyncio.Event
) -> None:
    """Kill -9 the broker leading usage and the changelog at ``kill_at`` s into the load;
    start it again once its partitions are led elsewhere (30 s at most)."""
    try:
        await asyncio.sleep(max(0.0, w.load_started + kill_at - time.monotonic()))
        usage = stack.settings.topic("usage")
        changelog = f"{stack.settings.app_id}-keystate-changelog"
        nodes = cluster.kafka.node_ids
        found: list[tuple[str, int, int]] = []
        for _ in range(10):
            found = await describe(stack, cluster, [usage, changelog])
            if found:
                break
            await asyncio.sleep(0.5)
        leads = {n: [f"{t}[{p}]" for t, p, leader in found if leader == n] for n in nodes}

        def rank(n: int) -> tuple[int, int]:
            topics = {x.rsplit("[", 1)[0] for x in leads[n]}
            return (len(topics), len(leads[n]))

        f.victim = max(nodes, key=rank)
        f.led = leads[f.victim]
        cluster.kill(f.victim)
        killed = time.monotonic()
        w.killed, f.killed_at_s = killed, w.at(killed)
        say(f"  kill -9 broker {f.victim} (led {f.led}) at {f.killed_at_s} s")
        alive = [n for n in nodes if n != f.victim]
        if alive:
            deadline = killed + 30
            while time.monotonic() < deadline:
                now_found = await describe(stack, cluster, [usage, changelog], alive)
                if now_found and all(leader in alive for _, _, leader in now_found):
                    f.moved_after_s = round(time.monotonic() - killed, 2)
                    break
                await asyncio.sleep(0.25)
        began = time.monotonic()
        await asyncio.to_thread(cluster.kafka.up)
        f.restart_s = round(time.monotonic() - began, 2)
        say(f"  broker {f.victim} back after {f.restart_s} s")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - noted in the run's line
        f.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        restarted.set()


async def drive(
    args: argparse.Namespace, cluster: Cluster, stack: Stack, run: str, evidence: Path
) -> dict[str, Any]:
    """The load, the fault and the watch on a started stack; the figures (worker running)."""
    errors: list[str] = []
    fig: dict[str, Any] = {"errors": errors}
    t0 = time.monotonic()
    async with (
        open_load(run, stack, tenant_limit=ROOMY, global_limit=ROOMY) as load,
        httpx.AsyncClient() as http,
    ):
        # Policies published at once; the load starts when the worker is ready and both
        # admission processes vouch for every budget, whichever comes last.
        vouched = asyncio.create_task(ready(load, timeout_s=180))
        ready_url = f"http://127.0.0.1:{stack.metrics_port}/readyz"
        deadline = t0 + 180
        while time.monotonic() < deadline:
            reply = await get(http, ready_url, 1)
            if reply is not None and reply.status_code == 200:
                break
            if (why := crash(stack)) is not None:
                raise RuntimeError(why)
            await asyncio.sleep(0.1)
        else:
            raise TimeoutError("the worker's /readyz did not answer 200 within 180 s")
        fig["readyz_after_s"] = round(time.monotonic() - t0, 2)
        await vouched
        started = time.monotonic()
        fig["load_started_after_s"] = round(started - t0, 2)
        say(
            f"  /readyz 200 after {fig['readyz_after_s']} s; load starts after "
            f"{fig['load_started_after_s']} s"
        )
        w = Watch(started, args.stall_s, args.fault_stall_s)
        stop = asyncio.Event()
        end = started + args.seconds
        interval = len(stack.urls) / args.rate
        admitters = [
            asyncio.create_task(paced_admitter(load, url, stop, interval, end))
            for url in stack.urls
        ]
        # The watch goes on through the settling and the convergence (bounded).
        watcher = asyncio.create_task(watch(w, stack, http, evidence, end + 240))
        f, restarted = Fault(), asyncio.Event()
        killer = asyncio.create_task(fault(cluster, stack, w, args.kill_at, f, restarted))

        async def loaded() -> None:
            while time.monotonic() < end:
                if (why := crash(stack)) is not None:
                    raise RuntimeError(why)
                await asyncio.sleep(0.2)

        try:
            completed = await until_stalled(w.stalled, loaded())
        except RuntimeError as exc:
            errors.append(str(exc))
            completed = False
        stop.set()
        await asyncio.gather(*admitters, return_exceptions=True)
        fig["load_s"] = round(time.monotonic() - started, 2)
        if w.stall is None and completed:
            await until_stalled(
                w.stalled, bounded(load.resolve(), 90, "admits decided after the load", errors)
            )
            if w.stall is None:
                pending = [t for t in load.settles if not t.done()]
                if pending:
                    await until_stalled(
                        w.stalled,
                        bounded(asyncio.gather(*pending), 90, "reservations settled", errors),
                    )
        if not killer.done() and f.killed_at_s is None:
            killer.cancel()  # the run ended before the kill
        if w.stall is None and completed:
            converged = await until_stalled(
                w.stalled,
                bounded(load.converged(run, timeout_s=120), 130, "windows == ledger", errors),
            )
            fig["converged_after_load_s"] = (
                round(time.monotonic() - end, 2) if converged and w.stall is None else None
            )
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        # The comparison as it stands now (after waiting, unless stalled).
        client = stack.client()
        try:
            got, expected = load.windows(client), load.expected()
            pending_units = load.pending(client)
        except (redis.RedisError, OSError) as exc:
            got, expected, pending_units = {}, load.expected(), {}
            errors.append(f"reading the windows: {exc!r}")
        finally:
            client.close()
        diff = {k: [expected[k], got.get(k)] for k in expected if expected[k] != got.get(k)}
        reply = await get(http, f"http://127.0.0.1:{stack.metrics_port}/metrics", 5)
        parsed = parse_metrics(reply.text if reply is not None else w.last_metrics)
        fig.update(
            stalled=w.stall is not None,
            stall=w.stall,
            stall_at_s=None if w.stall is None else w.stall["at_s"],
            windows_equal_ledger=not diff and bool(expected),
            windows_diff=dict(list(diff.items())[:8]),
            pending_units=sum(pending_units.values()),
            ledger_units=sum(expected.get(k, 0) for k in (load.global_policy,)),
            admits=dict(sorted(load.codes().items())),
            settles=dict(sorted(load.settle_codes().items())),
            acked_events=len(load.acked),
            wrong=load.wrong[:5],
            max_gap_s=w.max_gap_s,
            max_gap_began_s=w.max_gap_began_s,
            max_undecidable_s=w.max_undecidable_s,
            watch_samples=w.samples,
            events_and_keyed_counted=w.counted,
            end_offsets=w.end_offsets,
            applied_offsets=w.applied,
            **{n: metric_sum(parsed, n) for n in FIX_COUNTERS},
        )
        if not killer.done():
            # A restart under way finishes before the next run (the cluster must be whole).
            await asyncio.wait({killer}, timeout=200)
        fig.update(
            killed_broker=f.victim,
            killed_led=f.led,
            kill_at_s=f.killed_at_s,
            leaders_moved_after_s=f.moved_after_s,
            broker_restart_s=f.restart_s,
            fault_error=f.error or None,
        )
    return fig


def terminate(proc: subprocess.Popen[bytes]) -> tuple[int | None, float | None, bool]:
    """SIGTERM, wait up to 45 s, then kill -9: (exit code, seconds to exit, killed)."""
    if proc.poll() is not None:
        return proc.returncode, None, False
    began = time.monotonic()
    proc.terminate()
    try:
        code = proc.wait(timeout=TERM_GRACE_S)
        return code, round(time.monotonic() - began, 2), False
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=30), None, True


def replay_verify(stack: Stack, out: Path) -> int | None:
    """``spendgate replay --verify`` on the run's topics and keys (its output kept)."""
    env = {**settings_env(stack.settings), **stack.worker_env}
    env["SPENDGATE_PARTITIONS"] = str(stack.settings.partitions)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "spendgate", "replay", "--verify"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    except subprocess.TimeoutExpired:
        out.write_text("timed out after 240 s\n")
        return None
    out.write_text(done.stdout + done.stderr)
    return done.returncode


def one_run(
    args: argparse.Namespace, cluster: Cluster, redis_url: str, number: int, sha: str
) -> dict[str, Any]:
    began = time.monotonic()
    line: dict[str, Any] = {
        "run": number,
        "stack": args.stack,
        "commit": sha,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": args.seconds,
        "rate": args.rate,
        "kill_at": args.kill_at,
    }
    logs = args.work_dir / "runs" / f"{args.stack}-{number}-{uuid.uuid4().hex[:6]}"
    evidence = Path(f"{args.out}.evidence") / f"{args.stack}-{number}"
    # The cluster whole again (a broker a failed restart left down started now).
    cluster.kafka.up()
    stack = start_stack(
        cluster.kafka.bootstrap,
        logs,
        redis_url,
        replication=(cluster.kafka.replication_factor, cluster.kafka.min_insync_replicas),
    )
    line["logs"] = str(logs)
    line["worker_pid"] = stack.worker.pid
    fig: dict[str, Any] = {}
    try:
        fig = asyncio.run(drive(args, cluster, stack, f"r{number}", evidence))
    except Exception as exc:  # noqa: BLE001 - the run's line says what failed
        fig = {"errors": [f"{type(exc).__name__}: {str(exc)[:500]}"]}
    finally:
        code, exit_s, killed = terminate(stack.worker)
        line.update(worker_exit_code=code, sigterm_exit_s=exit_s, sigterm_killed_after_45s=killed)
        for proc in stack.admissions:
            proc.stop()
        stack.workers.stop_all()
    line.update(fig)
    line.setdefault("stalled", None)
    line["replay_verify_exit"] = replay_verify(stack, logs / "replay-verify.txt")
    line["evidence"] = str(evidence) if evidence.exists() else None
    line["run_s"] = round(time.monotonic() - began, 1)
    if line.get("stalled") is False and not line["errors"]:
        shutil.rmtree(logs / "tables", ignore_errors=True)
    return line


# --- the series -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.stall_repro",
        description="Issue 52's stall reproducer: fresh worker + two admission processes "
        "under load with a broker kill, a watch for a worker that stops applying, one "
        "JSON line per run.",
    )
    ap.add_argument("--stack", choices=sorted(STACKS), default="sasl_ssl3")
    ap.add_argument("--runs", type=int, default=1, help="runs at most (default 1)")
    ap.add_argument(
        "--budget-min",
        type=float,
        default=0.0,
        help="start no run after this many minutes (0: no limit)",
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="load per run (default 60)")
    ap.add_argument("--rate", type=float, default=20.0, help="admits/s over both processes")
    ap.add_argument(
        "--kill-at", type=float, default=20.0, help="kill -9 of a leader, s into the load"
    )
    ap.add_argument(
        "--stall-s",
        type=float,
        default=15.0,
        help="no applied progress while records wait (or /v1/status undecidable) this long "
        "is a stall (default 15)",
    )
    ap.add_argument(
        "--fault-stall-s",
        type=float,
        default=45.0,
        help="the same for a pause that began after the kill (default 45)",
    )
    ap.add_argument(
        "--cluster-port",
        type=int,
        default=CLUSTER_PORT,
        help=f"node 1's client port, at most 32000 (controllers +100, SASL_SSL "
        f"replication +200; default {CLUSTER_PORT}): two series at once need their own",
    )
    ap.add_argument("--out", type=Path, required=True, help="results file (JSON lines, appended)")
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/stall-repro"),
        help="cluster state, Redis and the runs' logs (default /tmp/stall-repro)",
    )
    args = ap.parse_args(argv)
    if args.runs < 1 or args.seconds <= 0 or args.rate <= 0:
        ap.error("--runs, --seconds and --rate must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("java") is None or not Path(REDIS_SERVER).exists():
        print("java and redis-server are needed", file=sys.stderr)
        return 2
    # This process's own Kafka clients: a killed broker is expected, not worth a line each.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    # SIGTERM as Ctrl-C: the finally blocks stop the stack, the cluster and Redis.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    brokers, security = STACKS[args.stack]
    settings = KafkaClusterSettings(
        kafka_cluster_port=args.cluster_port, stack_dir=args.work_dir / "kafka"
    )
    cluster = Cluster(LocalKafkaCluster(settings, brokers, security), security)  # type: ignore[arg-type]
    sha = git_sha(Path.cwd())
    own_redis = OwnRedis(args.work_dir)
    series_began = time.monotonic()
    done = stalls = 0
    first = previous_runs(args.out, args.stack) + 1
    try:
        cluster.stop()  # leftovers of an interrupted series (recorded pids only)
        cluster.kafka.wipe()
        cluster.wait_ports_free(30)
        say(f"{args.stack}: starting {brokers} broker(s) ({security}) on {args.cluster_port}...")
        up = time.monotonic()
        cluster.kafka.up()
        say(f"cluster up in {time.monotonic() - up:.1f} s")
        # Every child (worker, admission, replay) and this process's clients reach it so.
        os.environ.update(cluster.env())
        own_redis.start()
        for i in range(args.runs):
            if args.budget_min and time.monotonic() - series_began > args.budget_min * 60:
                say(f"budget of {args.budget_min} min spent: no more runs")
                break
            number = first + i
            say(f"run {number} ({args.stack}, commit {sha[:7]})")
            line = one_run(args, cluster, own_redis.url, number, sha)
            with open(args.out, "a") as out:
                out.write(json.dumps(line, default=str) + "\n")
            done += 1
            stalls += bool(line.get("stalled"))
            say(
                f"run {number}: stalled={line.get('stalled')} at={line.get('stall_at_s')} "
                f"windows==ledger={line.get('windows_equal_ledger')} "
                f"replay={line['replay_verify_exit']} exit={line['worker_exit_code']} "
                f"in {line['sigterm_exit_s']} s; max gap {line.get('max_gap_s')} s; "
                f"{line['run_s']} s; errors {line.get('errors')}"
            )
            with contextlib.suppress(redis.RedisError):
                redis.Redis.from_url(own_redis.url).flushall()
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        own_redis.stop()
        cluster.stop()
        say(
            f"{args.stack}: {stalls} stalled of {done} runs in "
            f"{(time.monotonic() - series_began) / 60:.1f} min; lines in {args.out}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
