"""Issue 44's Kafka fault tests: the guarantees re-proven on a three-broker cluster.

One KRaft cluster of three combined broker+controller nodes (``spendgate.devkafka``, on
ports of this module's own) is started once for the module; every topic the stack
creates, faust's changelog included, has replication factor 3 and
``min.insync.replicas`` 2; the store is a single Redis of the module's own. A real
``spendgate worker`` and real ``spendgate admission`` processes run under admits over HTTP
(each admitted reservation committed or released, a 503 retried with the same call) and
commits produced straight to Kafka, with an exact ledger kept by the test, while:

1. the broker leading a partition of ``usage`` and one of the worker's changelog is
   killed (``kill -9``) right after its followers were paused for a moment (SIGSTOP,
   1.5 s: the leader then holds records its followers have not copied, the case that
   loses an acknowledged record when ``acks`` is lowered);
2. the broker leading ``usage`` is paused (SIGSTOP) past the brokers' session timeout
   (6 s: the controller fences it and its partitions are led elsewhere), then resumed;
3. two brokers of three are killed (fewer in-sync replicas than ``min.insync.replicas``,
   and the controller quorum gone with them) while admission processes with a publish
   buffer of 16 answer policies failing closed, open and degraded.

Each killed broker is started again afterwards, as a supervisor would: the cases after it
need three brokers (with one gone, a second loss would stop every ``acks=all`` write), and
a returning broker catching up under load is part of what is proven.

Each time: every answer 2xx (a 200 admit's reserve, a 202 commit or release) and every
record the broker acked to the test is in the ``usage`` log, the windows in Redis equal
the ledger (nothing lost, nothing counted twice), nothing is left pending, every admission
process still runs, and the worker's log shows no crashed agent and no traceback.

In cases 1 and 2 the worker process also lives on: the same process throughout. In case 3
it need not: that case asks for no lost answer, not for the worker to ride through, and
the worker has been seen to stop by itself after the brokers came back (exit 1 with "the
worker stopped without a signal", ``streams.worker.execute``; about once in 14 runs), so
the test starts it again as a supervisor would (``Stack.restart_on_self_stop``) and
prints how often it did; the same process is not required there. A worker that exits any
other way (another exit code, or no such line in its log) still fails case 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from spendgate.devkafka import KafkaClusterSettings, LocalKafkaCluster
from spendgate.schemas import kafka_connect
from spendgate.schemas.kafka_connect import KafkaConnection, TopicReplication
from spendgate.streams.topics import describe_replication
from tests.fixtures.admission import REDIS_SERVER, OwnRedis
from tests.fixtures.dashboard import Process
from tests.fixtures.kafka_io import read_records
from tests.fixtures.load_stack import (
    Load,
    Stack,
    crash,
    no_crash,
    open_load,
    ports,
    ready,
    start_admissions,
    start_stack,
    until,
    wait_answering,
)
from tests.fixtures.services import _unavailable, say

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

#: Clients on 30400-30402, controllers on 30500-30502: below the ephemeral range and apart
#: from tests/test_devkafka_cluster.py's clusters (29400-29502, 29700-29902).
OWN_PORTS = 30400
REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2
#: The publish buffer of case 3's admission processes: full within a second of load.
PUBLISH_BUFFER = 16
#: Limits no load meets: every admit is admitted and settled, so reserves and commits
#: flow through every fault.
ROOMY = 10**8
#: How long the followers are paused before their leader is killed (case 1).
FOLLOWERS_PAUSED_S = 1.5
#: How long a broker is paused (case 2): past ``broker.session.timeout.ms`` (6 s).
PAUSED_S = 8.0
#: How long case 3's brokers stay down once both buffers are full.
FULL_FOR_S = 3.0
#: Settled calls answered 202 after the recovery before the load stops.
AFTER = 30


# --- the cluster and the stack --------------------------------------------------------------


@dataclass
class KafkaStack:
    """The cluster, the stack on it (admission with the default publish buffer), and
    case 3's admission processes (a buffer of 16) beside the same worker."""

    cluster: LocalKafkaCluster
    stack: Stack
    small: Stack
    started: float

    @property
    def kafka(self) -> KafkaConnection:
        return self.stack.settings.kafka()

    @property
    def topics(self) -> list[str]:
        """The topics whose leaders the faults strike: usage and the table's changelog."""
        return [self.stack.settings.topic("usage"), self.changelog]

    @property
    def changelog(self) -> str:
        return f"{self.stack.settings.app_id}-keystate-changelog"

    def pid(self, node: int) -> int:
        pid = self.cluster.pid(node)
        assert pid is not None, f"broker {node} is not running"
        return pid

    def log_files(self) -> list[Path]:
        return self.stack.log_files()


@pytest.fixture(scope="module")
def kafka_stack(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[KafkaStack]:
    """The three-broker cluster, a Redis, a worker and four admission processes."""
    if shutil.which("java") is None:
        _unavailable("java is needed for the three-broker cluster")
    if not Path(REDIS_SERVER).exists():
        _unavailable("redis-server is not installed")
    started = time.monotonic()
    base = tmp_path_factory.mktemp("kafka-faults")
    cluster = LocalKafkaCluster(
        KafkaClusterSettings(kafka_cluster_port=OWN_PORTS, stack_dir=base), 3, "plaintext"
    )
    for node in cluster.node_ids:
        for port in (cluster.port(node), cluster.controller_port(node)):
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is in use"
    own_redis = OwnRedis(base)
    own_redis.start()
    stack: Stack | None = None
    admissions: list[Process] = []
    try:
        cluster.up()
        up_s = time.monotonic() - started
        stack = start_stack(
            cluster.bootstrap,
            base / "stack",
            own_redis.url,
            replication=(REPLICATION_FACTOR, MIN_INSYNC_REPLICAS),
        )
        taken = {stack.metrics_port, *(int(u.rsplit(":", 1)[1]) for u in stack.urls)}
        env = {
            "SPENDGATE_STALENESS_S": "30",
            "SPENDGATE_KAFKA_REPLICATION_FACTOR": str(REPLICATION_FACTOR),
            "SPENDGATE_KAFKA_MIN_INSYNC_REPLICAS": str(MIN_INSYNC_REPLICAS),
            "SPENDGATE_PUBLISH_BUFFER": str(PUBLISH_BUFFER),
        }
        admissions, urls = start_admissions(
            stack.settings,
            stack.logs,
            env,
            [p for p in ports(len(taken) + 2) if p not in taken][:2],
            name="small-buffer",
        )
        small = replace(stack, admissions=admissions, urls=urls)
        wait_answering(stack)
        wait_answering(small)
        ks = KafkaStack(cluster, stack, small, started)
        asyncio.run(_whole(ks, 60))
        replication = asyncio.run(_replication(ks))
        assert {(t.replication_factor, t.min_insync_replicas) for t in replication} == {
            (REPLICATION_FACTOR, MIN_INSYNC_REPLICAS)
        }, replication
        say(
            pytestconfig,
            f"kafka faults: 3-broker cluster up in {up_s:.1f} s, "
            f"stack answering {time.monotonic() - started:.1f} s after the start",
        )
        yield ks
    finally:
        stopping = time.monotonic()
        if stack is not None:
            for proc in stack.admissions + admissions:
                proc.stop()
            stack.workers.stop_all()
        # Killed, not stopped: the cluster's state is thrown away, and a controlled
        # shutdown of three nodes at once can wait 30 s for a quorum.
        for node in cluster.node_ids:
            if (pid := cluster.pid(node)) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        cluster.down()
        own_redis.stop()
        say(
            pytestconfig,
            f"kafka faults: stopped in {time.monotonic() - stopping:.1f} s; the whole module "
            f"took {time.monotonic() - started:.1f} s wall",
        )


@pytest.fixture
def show_logs(request: pytest.FixtureRequest, kafka_stack: KafkaStack) -> None:
    """A failing test shows the tails of every process's log."""
    request.node.spendgate_logs = kafka_stack.log_files


# --- the brokers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    topic: str
    partition: int
    leader: int
    isr: tuple[int, ...]


async def _describe(ks: KafkaStack, nodes: list[int] | None = None) -> list[Partition]:
    """The partitions of usage and the changelog as the brokers ``nodes`` (default: all)
    describe them; [] when none answers in time."""
    cluster = ks.cluster
    bootstrap = ",".join(f"127.0.0.1:{cluster.port(n)}" for n in nodes or cluster.node_ids)
    admin = kafka_connect.admin(
        ks.kafka.model_copy(update={"bootstrap": bootstrap}), request_timeout_ms=3000
    )
    try:
        await asyncio.wait_for(admin.start(), 5)
        # Only topics that exist: a metadata request naming a missing topic creates it
        # (auto.create.topics.enable), and faust must create the changelog itself, with
        # its source topic's partitions.
        present = set(await asyncio.wait_for(admin.list_topics(), 5))
        wanted = [t for t in ks.topics if t in present]
        described = await asyncio.wait_for(admin.describe_topics(wanted), 5) if wanted else []
    except Exception:  # noqa: BLE001 - not answering (yet): asked again
        return []
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(admin.close(), 5)
    out = []
    for topic in described:
        for p in topic["partitions"]:
            out.append(
                Partition(topic["topic"], p["partition"], p["leader"], tuple(sorted(p["isr"])))
            )
    return sorted(out, key=lambda p: (p.topic, p.partition))


async def _replication(ks: KafkaStack) -> list[TopicReplication]:
    """The replication of every topic the stack created, faust's changelog included."""
    settings = ks.stack.settings
    names = [settings.topic(t) for t in ("usage", "policies", "alerts", "dlq", "refusals")]
    admin = kafka_connect.admin(ks.kafka)
    await admin.start()
    try:
        return await describe_replication(admin, [*names, settings.keyed_topic, ks.changelog])
    finally:
        await admin.close()


async def _whole(ks: KafkaStack, timeout_s: float) -> list[Partition]:
    """Wait until every partition of usage and the changelog has a leader and three
    in-sync replicas; the partitions."""
    deadline = time.monotonic() + timeout_s
    found: list[Partition] = []
    while True:
        found = await _describe(ks)
        if len({p.topic for p in found}) == 2 and all(
            p.leader in ks.cluster.node_ids and len(p.isr) == 3 for p in found
        ):
            return found
        assert time.monotonic() < deadline, f"the cluster is not whole: {found}"
        await asyncio.sleep(0.5)


async def _led_elsewhere(ks: KafkaStack, gone: set[int], timeout_s: float) -> float:
    """Wait until no partition of usage or the changelog is led by a broker of ``gone``,
    asking the others only; when that happened (monotonic)."""
    alive = [n for n in ks.cluster.node_ids if n not in gone]
    deadline = time.monotonic() + timeout_s
    while True:
        found = await _describe(ks, alive)
        if found and all(p.leader in alive for p in found):
            return time.monotonic()
        assert time.monotonic() < deadline, f"leaders not moved off {gone}: {found}"
        await asyncio.sleep(0.25)


def _signal(ks: KafkaStack, nodes: list[int], sig: signal.Signals) -> None:
    for node in nodes:
        os.kill(ks.pid(node), sig)
    if sig == signal.SIGKILL:
        for node in nodes:
            # Reaped here: a restart replaces the cluster's handle of the node, and a
            # handle dropped unreaped is a ResourceWarning (an error in this suite).
            child = ks.cluster._children.get(node)
            if child is not None:
                child.wait(timeout=10)


async def _restart(ks: KafkaStack) -> float:
    """Start the brokers that are not running again (as their supervisor would) and wait
    until every one is in the metadata; how long it took."""
    began = time.monotonic()
    await asyncio.to_thread(ks.cluster.up)
    return time.monotonic() - began


# --- the load and what must hold ------------------------------------------------------------


def _admission_metric(urls: list[str], name: str, label: str = "") -> float:
    """A metric of the admission processes at ``urls``, summed (lines holding ``label``)."""
    total = 0.0
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")) and label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.asynccontextmanager
async def _under(loads: list[Load], *, direct: bool = True) -> AsyncIterator[float]:
    """Admitters on every admission process of each load (and its direct commits) until
    the block ends; then every 503 asked again and every reservation settled. Yields when
    the load started."""
    stop = asyncio.Event()
    tasks = []
    for load in loads:
        tasks += [asyncio.create_task(load.admitter(url, stop)) for url in load.stack.urls]
        if direct:
            tasks.append(asyncio.create_task(load.direct(stop)))
    try:
        yield time.monotonic()
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    for load in loads:
        await load.resolve()
    await asyncio.gather(*(t for load in loads for t in load.settles))


def _recovered(load: Load, since: float) -> float | None:
    """When settling worked again after ``since``: the first 202 after the last failed
    settle call (``since`` itself when none failed); None while the last one failed."""
    after = [(t, s) for t, s in load.settle_answers if t >= since]
    failed = [t for t, s in after if s != 202]
    if not failed:
        return since
    ok = [t for t, s in after if s == 202 and t > failed[-1]]
    return ok[0] if ok else None


async def _settled_again(load: Load, since: float, timeout_s: float) -> float:
    """Wait until settling works again after ``since`` and ``AFTER`` calls were answered
    202 since then; when it worked again."""

    def enough() -> bool:
        back = _recovered(load, since)
        return back is not None and sum(
            1 for t, s in load.settle_answers if t > back and s == 202
        ) >= min(AFTER, 10 * len(load.stack.urls))

    await until(load.stack, enough, timeout_s, "settlements answered 202 again")
    back = _recovered(load, since)
    assert back is not None
    return back


async def _verify(load: Load, name: str, pid: int | None) -> dict[str, Any]:
    """Every assertion of the issue once the load stopped; the figures of the run (``pid``:
    the worker rode through in this process; None: it may have been started again)."""
    stack = load.stack
    assert not load.wrong, load.wrong[:10]
    converge_error = ""
    try:
        await load.converged(name, timeout_s=90)
    except AssertionError as exc:
        converge_error = str(exc)
    client = stack.client()
    try:
        got, expected = load.windows(client), load.expected()
        pending = load.pending(client)
    finally:
        client.close()
    records = await read_records(stack.settings.kafka_bootstrap, stack.settings.topic("usage"))
    in_log = Counter(str(orjson.loads(r.value or b"{}").get("event_id")) for r in records)
    missing = sorted(load.acked - set(in_log))
    # Units once each: the global budget holds every admitted unit, direct-all every
    # direct one (the per-tenant keys hold them a second time, compared by converged).
    totals = [load.global_policy, f"{load.run}-direct-all"]
    lost = sum(max(0, expected[k] - got[k]) for k in totals)
    doubled = sum(max(0, got[k] - expected[k]) for k in totals)
    figures = {
        "case": name,
        "admits": dict(sorted(load.codes().items())),
        "settles": dict(sorted(load.settle_codes().items())),
        "acked_events": len(load.acked),
        "acked_missing_from_log": len(missing),
        "copies_in_log": sum(in_log[e] - 1 for e in load.acked if in_log[e] > 1),
        "ledger_units": sum(expected[k] for k in totals),
        "window_units": sum(got[k] for k in totals),
        "keys_differing": sum(1 for k in expected if expected[k] != got[k]),
        "lost_units": lost,
        "doubled_units": doubled,
        "pending": sum(pending.values()),
        "settled_through_kafka": load.lost_records,
    }
    print(f"\n{name}: " + " ".join(f"{k}={v}" for k, v in figures.items()))
    assert not missing, f"{name}: {len(missing)} answers 2xx not in the log: {missing[:10]}"
    assert not converge_error, converge_error
    assert (lost, doubled) == (0, 0)
    # The worker rode through: the same process, alive, no agent crashed.
    assert pid is None or stack.worker.pid == pid, "the worker was started again"
    assert crash(stack) is None, crash(stack)
    no_crash(stack)
    for proc in stack.admissions:
        assert proc.proc.poll() is None, f"{proc.log.name} exited"
    return figures


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.usefixtures("show_logs")
class TestKafkaFaults:
    async def test_kill_9_of_the_leader_of_usage_and_of_the_changelog(
        self, kafka_stack: KafkaStack
    ) -> None:
        ks, wall = kafka_stack, time.monotonic()
        stack, pid = ks.stack, ks.stack.worker.pid
        found = await _whole(ks, 60)
        usage = ks.topics[0]
        # Two partitions per topic over three brokers: some broker leads a partition of
        # each (a leader per partition, 2 + 2 > 3).
        leads = {n: {p.topic for p in found if p.leader == n} for n in ks.cluster.node_ids}
        victim = max(ks.cluster.node_ids, key=lambda n: (len(leads[n]), n in leads))
        assert leads[victim] == {usage, ks.changelog}, leads
        followers = [n for n in ks.cluster.node_ids if n != victim]
        async with open_load("k1", stack, tenant_limit=ROOMY, global_limit=ROOMY) as load:
            await ready(load)
            async with _under([load]) as started:
                await until(
                    stack,
                    lambda: len(load.decided(started)) >= 20 and time.monotonic() - started > 2,
                    30,
                    "admits decided before the fault",
                )
                _signal(ks, followers, signal.SIGSTOP)
                try:
                    await asyncio.sleep(FOLLOWERS_PAUSED_S)
                    _signal(ks, [victim], signal.SIGKILL)
                    killed = time.monotonic()
                finally:
                    _signal(ks, followers, signal.SIGCONT)
                moved = await _led_elsewhere(ks, {victim}, 30)
                restart = asyncio.create_task(_restart(ks))
                back = await _settled_again(load, killed, 90)
            restart_s = await restart
            figures = await _verify(load, "leader kill", pid)
        await _whole(ks, 60)
        print(
            f"  killed broker {victim} (led {sorted(leads[victim])}); leaders moved "
            f"{moved - killed:.1f} s after the kill, settling worked again after "
            f"{back - killed:.1f} s; the broker restarted in {restart_s:.1f} s; "
            f"{time.monotonic() - wall:.1f} s wall"
        )
        assert figures["settles"].get(202, 0) > AFTER

    async def test_a_broker_paused_past_the_session_timeout(self, kafka_stack: KafkaStack) -> None:
        ks, wall = kafka_stack, time.monotonic()
        stack, pid = ks.stack, ks.stack.worker.pid
        found = await _whole(ks, 60)
        usage = ks.topics[0]
        victim = Counter(p.leader for p in found if p.topic == usage).most_common(1)[0][0]
        async with open_load("p1", stack, tenant_limit=ROOMY, global_limit=ROOMY) as load:
            await ready(load)
            async with _under([load]) as started:
                await until(
                    stack,
                    lambda: len(load.decided(started)) >= 20 and time.monotonic() - started > 2,
                    30,
                    "admits decided before the fault",
                )
                _signal(ks, [victim], signal.SIGSTOP)
                paused = time.monotonic()
                try:
                    moved = await _led_elsewhere(ks, {victim}, PAUSED_S + 10)
                    await asyncio.sleep(max(0.0, paused + PAUSED_S - time.monotonic()))
                finally:
                    _signal(ks, [victim], signal.SIGCONT)
                resumed = time.monotonic()
                back = await _settled_again(load, paused, 90)
            figures = await _verify(load, "broker paused", pid)
        await _whole(ks, 60)
        print(
            f"  paused broker {victim} for {resumed - paused:.1f} s; leaders moved "
            f"{moved - paused:.1f} s after the pause, settling worked again "
            f"{back - paused:.1f} s after it; {time.monotonic() - wall:.1f} s wall"
        )
        assert figures["settles"].get(202, 0) > AFTER

    async def test_two_of_three_brokers_down(self, kafka_stack: KafkaStack) -> None:
        ks, wall = kafka_stack, time.monotonic()
        stack = ks.small
        # The issue asks this case for no lost answer, not for the worker to ride through:
        # once in about 14 runs it stopped by itself after the brokers came back (exit 1,
        # streams.worker.execute). A supervisor starts it again; so does this test.
        stack.restart_on_self_stop = True
        found = await _whole(ks, 60)
        usage = ks.topics[0]
        # The survivor leads the fewest partitions of usage: most lose their leader.
        by_leader = Counter(p.leader for p in found if p.topic == usage)
        survivor = min(ks.cluster.node_ids, key=lambda n: (by_leader[n], n))
        victims = [n for n in ks.cluster.node_ids if n != survivor]
        modes = ("closed", "open", "degraded")
        async with contextlib.AsyncExitStack() as opened:
            loads = {
                mode: await opened.enter_async_context(
                    open_load(
                        f"c3{mode}", stack, failure=mode, tenant_limit=ROOMY,
                        global_limit=ROOMY, settle_s=120,
                    )
                )
                for mode in modes
            }  # fmt: skip
            for load in loads.values():
                await ready(load)

            def metric(name: str, label: str = "") -> float:
                return _admission_metric(stack.urls, name, label)

            overflow = "spendgate_admission_publish_overflow_total"
            before = {a: metric(overflow, f'action="{a}"') for a in ("refused", "admitted")}
            async with _under(list(loads.values()), direct=False) as started:
                await until(
                    stack,
                    lambda: (
                        all(len(ld.decided(started)) >= 5 for ld in loads.values())
                        and time.monotonic() - started > 1.5
                    ),
                    30,
                    "admits decided before the fault",
                )
                _signal(ks, victims, signal.SIGKILL)
                down = time.monotonic()
                per_process = [
                    lambda url=url: _admission_metric(
                        [url], "spendgate_admission_publish_buffer_events"
                    )
                    for url in stack.urls
                ]
                await until(
                    stack,
                    lambda: all(depth() >= PUBLISH_BUFFER for depth in per_process),
                    30,
                    "both publish buffers full",
                )
                full = time.monotonic()
                await asyncio.sleep(FULL_FOR_S)
                restarting = time.monotonic()
                restart_s = await _restart(ks)
                returned = time.monotonic()
                # Within 0-3.3 s on an idle machine; under the suite's load the restarted
                # brokers take much longer to rejoin the in-sync replicas.
                backs = {
                    mode: await _settled_again(load, returned, 150) for mode, load in loads.items()
                }
            during = {
                mode: Counter(
                    (a.status, a.code) for a in load.answers if full <= a.sent < restarting
                )
                for mode, load in loads.items()
            }
            after = {a: metric(overflow, f'action="{a}"') - before[a] for a in before}
            figures = {
                mode: await _verify(load, f"two brokers down, failing {mode}", None)
                for mode, load in loads.items()
            }
        stack.restart_on_self_stop = False
        print(f"  the worker stopped by itself {len(stack.restarts)} times: {stack.restarts}")
        await _whole(ks, 60)
        logs = "\n".join(p.log.read_text(errors="replace") for p in stack.admissions)
        print(
            f"  killed brokers {victims} (survivor {survivor}); both buffers full "
            f"{full - down:.1f} s after, brokers down {restarting - down:.1f} s, restarted "
            f"in {restart_s:.1f} s; settling worked again after "
            + ", ".join(f"{m} {backs[m] - returned:.1f} s" for m in modes)
            + f" ({time.monotonic() - wall:.1f} s wall)"
        )
        print(f"  answers while the buffers were full: {during}; overflow metric: {after}")
        # Each policy answered by its failure mode while the buffers were full: closed
        # refused with 503 publish_unavailable (none admitted), open and degraded admitted
        # (decided in Redis; their reserves republished from Redis once Kafka is back).
        assert during["closed"][(503, "publish_unavailable")] > 0, during["closed"]
        assert not [k for k in during["closed"] if k[0] == 200], during["closed"]
        for mode in ("open", "degraded"):
            assert during[mode][(200, "")] > 0, during[mode]
        assert after["refused"] > 0 and after["admitted"] > 0, after
        # Why: spendgate's own lines name the full buffer (the refusals of closed policies
        # included, once per 10 s); aiokafka's name the brokers.
        assert "the buffer is full" in logs and "failure mode" in logs
        assert "publish buffer full" in logs
        assert "NotEnoughReplicas" in logs or "NodeNotReadyError" in logs
        assert all(f["lost_units"] == 0 for f in figures.values())
