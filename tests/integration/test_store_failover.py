"""Issue 40's acceptance test: a store fault under load decides nothing wrong and loses nothing.

A real ``spendgate worker`` and two real ``spendgate admission`` processes, under admits over
HTTP (each admitted reservation committed or released) and commits produced straight to
Kafka, while their store fails:

* on a Redis Cluster of this module's own (3 masters, 3 replicas), ``kill -9`` of the master
  holding the global budget's key, three times in a row, healed in between (the killed
  node is started again once its replica is promoted, as a supervisor would: see
  ``promoted`` for why admission needs it back);
* on a single Redis of this module's own, stopped and started again empty.

Each time: the worker process lives and its log shows no crash; once the replica is
promoted (or Redis is back) an admit on the stricken budget is decided again (200/429)
within the staleness bound; no budget ever holds more than its limit (the limits are small
enough that the load meets them: 429s occur); and once the load stops the windows in Redis
equal the test's exact ledger (every reservation committed or released, the committed
amount in place of the estimate) and nothing is left pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spendgate.devcluster import ClusterSettings, LocalCluster
from spendgate.schemas.redis_keys import window_key
from tests.fixtures.admission import REDIS_SERVER, OwnRedis
from tests.fixtures.cluster import healed
from tests.fixtures.kafka_io import metric
from tests.fixtures.load_stack import (
    GLOBAL_LIMIT,
    STALENESS_S,
    TENANT_LIMIT,
    Load,
    Stack,
    crash,
    no_crash,
    open_load,
    ready,
    report,
    start_stack,
    until,
    wait_answering,
)
from tests.fixtures.services import Services, _unavailable

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.timeout(240)]

#: Below the ephemeral range and apart from the suite's cluster (7100) and
#: tests/test_devcluster.py's (7300): killing a node here disturbs no other test.
OWN_PORTS = 7400
#: Decided admits before the fault, and at least after the first decided one after it.
BEFORE = 15
AFTER = 30
#: How long the single Redis stays down under load.
OUTAGE_S = 3.0


# --- the stacks ---------------------------------------------------------------------------


@dataclass
class Stacks:
    cluster: Stack
    nodes: LocalCluster
    single: Stack
    own_redis: OwnRedis


@pytest.fixture(scope="module")
def stacks(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stacks]:
    """Both stacks, started side by side (their start-up waits overlap)."""
    if not Path(REDIS_SERVER).exists():
        _unavailable("redis-server is not installed")
    base = tmp_path_factory.mktemp("failover")
    nodes = LocalCluster(ClusterSettings(cluster_port=OWN_PORTS, stack_dir=base))
    for port in nodes.ports:
        for p in (port, port + 10_000):
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", p)) != 0, f"port {p} is in use"
    own_redis = OwnRedis(base)
    own_redis.start()
    started: list[Stack] = []
    try:
        single = start_stack(services.kafka_bootstrap, base / "on-single", own_redis.url)
        started.append(single)
        nodes.up()
        cluster = start_stack(
            services.kafka_bootstrap, base / "on-cluster", nodes.url, cluster_ports=nodes.ports
        )
        started.append(cluster)
        wait_answering(single)
        wait_answering(cluster)
        yield Stacks(cluster, nodes, single, own_redis)
    finally:
        for stack in started:
            stack.stop()
        nodes.down()
        own_redis.stop()


@pytest.fixture
def show_logs(request: pytest.FixtureRequest, stacks: Stacks) -> None:
    """A failing test shows the tails of every process's log."""
    request.node.spendgate_logs = lambda: stacks.cluster.log_files() + stacks.single.log_files()


# --- the faults -----------------------------------------------------------------------------


@dataclass
class Fault:
    """Breaks the store (returns when), then waits until it serves again (returns when)."""

    name: str
    inject: Callable[[Load], Awaitable[float]]
    recover: Callable[[Load], Awaitable[float]]


async def _ride_through(load: Load, fault: Fault) -> dict[str, Any]:
    """The load around one fault, then every assertion of the issue; returns the figures."""
    stack = load.stack
    await ready(load)
    errors_before = metric(stack.metrics_port, "spendgate_worker_store_errors_total")
    stop = asyncio.Event()
    started = time.monotonic()
    tasks = [asyncio.create_task(load.admitter(url, stop)) for url in stack.urls * 2]
    tasks.append(asyncio.create_task(load.direct(stop)))
    try:
        await until(
            stack,
            lambda: len(load.decided(started)) >= BEFORE and time.monotonic() - started > 1.5,
            30,
            "admits decided before the fault",
        )
        broken = await fault.inject(load)
        back = await fault.recover(load)
        try:
            await until(
                stack,
                lambda: any(load.on_global(a) for a in load.decided(back)),
                STALENESS_S + 15,
                "an admit decided on the stricken budget after the recovery",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last 503: {load.last_503}") from None
        first = min(a.answered for a in load.decided(back) if load.on_global(a))

        def enough() -> bool:
            after = load.decided(first)
            refused = {p for a in load.answers for p in a.violated}
            return len(after) >= AFTER and {f"{load.run}-tenant", load.global_policy} <= refused

        await until(stack, enough, 30, "the load meeting both limits after the recovery")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    await load.resolve()
    await asyncio.gather(*load.settles)
    load_s = time.monotonic() - started

    # The windows equal the ledger once the worker caught up: nothing lost, nothing twice.
    expected = await load.converged(fault.name)
    caught_up_s = time.monotonic() - started - load_s

    # No budget over its limit, and the limits were met (429s).
    limits = {f"{load.run}-tenant": TENANT_LIMIT, load.global_policy: GLOBAL_LIMIT}
    for key in expected:
        limit = limits.get(key.split("|")[0])
        if limit is not None:
            assert load.ledger[key] <= limit, f"{key}: {load.ledger[key]} committed > {limit}"
    assert not load.wrong, load.wrong[:10]
    codes = load.codes()
    assert codes[429] > 0 and codes[200] > 0, codes
    # Fail closed while the store is down: nothing sent after the fault was admitted
    # before the recovery (with the promotion's detection lag as slack).
    early = [a for a in load.answers if a.sent > broken and a.answered < back - 0.5]
    assert not [a for a in early if a.status == 200], "admitted while the store was down"
    assert codes[503] > 0, "no admit met the outage"
    decided_s = first - back
    assert decided_s <= STALENESS_S, f"first decided answer {decided_s:.1f} s after recovery"
    # The worker rode through: alive, no agent or timer crashed (faust restarts a crashed
    # agent: the process lives, the log tells). Its Redis errors are counted; on a cluster
    # there may be none (redis-py's own cluster retries can ride through a failover).
    assert crash(stack) is None, crash(stack)
    no_crash(stack)
    for proc in stack.admissions:
        assert proc.proc.poll() is None, f"{proc.log.name} exited"
    errors = metric(stack.metrics_port, "spendgate_worker_store_errors_total") - errors_before
    return {
        "fault": fault.name,
        "outage_s": round(back - broken, 1),
        "decided_after_s": round(decided_s, 2),
        "answers": {k: codes[k] for k in sorted(codes)},
        "lost_records": load.lost_records,
        "worker_store_errors": errors,
        "load_s": round(load_s, 1),
        "caught_up_s": round(caught_up_s, 1),
        "ledger": {k: v for k, v in expected.items() if v},
    }


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.usefixtures("show_logs")
class TestStoreFailover:
    async def test_kill_9_of_a_master_three_times_in_a_row(self, stacks: Stacks) -> None:
        stack, nodes = stacks.cluster, stacks.nodes
        wall = time.monotonic()
        killed: dict[str, Any] = {}

        async def kill_the_global_master(load: Load) -> float:
            policy = next(p for p in load.policies if p.id == load.global_policy)
            name = window_key(stack.layout.of_key(policy, policy.id), policy.id)
            with contextlib.closing(stack.client()) as client:
                port = client.get_node_from_key(name).port  # type: ignore[attr-defined]
            assert nodes.role(port) == "master", port
            killed["port"] = port
            killed["masters"] = {p for p in nodes.ports if nodes.role(p) == "master"}
            pid = nodes.pid(port)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            return time.monotonic()

        async def promoted(load: Load) -> float:
            masters = killed["masters"]

            def replica_promoted() -> bool:
                return any(p not in masters and nodes.role(p) == "master" for p in nodes.ports)

            deadline = time.monotonic() + 30
            while not replica_promoted():
                assert time.monotonic() < deadline, "no replica promoted in 30 s"
                await asyncio.sleep(0.05)
            at = time.monotonic()
            # The killed node comes back as its supervisor would restart it, and rejoins as
            # the new master's replica: with one replica per master, admission's default
            # WAIT for one replica (SPENDGATE_REDIS_WAIT_REPLICAS=1) answers nothing held
            # on the promoted master until a replica of it acknowledges again.
            nodes.start_node(killed["port"])
            return at

        fault = Fault("kill -9 of a master", kill_the_global_master, promoted)
        for run in ("r1", "r2", "r3"):
            async with open_load(run, stack) as load:
                try:
                    figures = await _ride_through(load, fault)
                finally:
                    await asyncio.to_thread(healed, nodes)
            print(f"\n{run}: killed master {killed['port']}")
            report(figures)
        no_crash(stack)
        print(f"cluster, three runs: {time.monotonic() - wall:.1f} s wall")

    async def test_a_single_redis_restarted_under_load(self, stacks: Stacks) -> None:
        stack, server = stacks.single, stacks.own_redis
        wall = time.monotonic()

        async def stop(load: Load) -> float:
            await asyncio.to_thread(server.stop)
            return time.monotonic()

        async def start(load: Load) -> float:
            await asyncio.sleep(OUTAGE_S)
            await asyncio.to_thread(server.start)  # empty: no persistence
            return time.monotonic()

        async with open_load("s1", stack) as load:
            figures = await _ride_through(load, Fault("single Redis restarted", stop, start))
        assert figures["worker_store_errors"] > 0, "the outage never reached the worker"
        print("\ns1: single Redis restarted")
        report(figures)
        no_crash(stack)
        print(f"single Redis: {time.monotonic() - wall:.1f} s wall")
