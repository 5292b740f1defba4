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
import random
import signal
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from aiokafka import AIOKafkaProducer
from redis.cluster import ClusterNode, RedisCluster

from spendgate.devcluster import ClusterSettings, LocalCluster
from spendgate.schemas.layout import Layout
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import window_key
from spendgate.streams.policy_admin import publish_policies
from spendgate.streams.settings import WorkerSettings
from tests.fixtures import held
from tests.fixtures.admission import REDIS_SERVER, OwnRedis, free_port
from tests.fixtures.cluster import healed
from tests.fixtures.dashboard import Process
from tests.fixtures.kafka_io import eventually, metric, window_sum
from tests.fixtures.pipeline import Workers, settings_env
from tests.fixtures.seeds import derive
from tests.fixtures.services import Services, _unavailable

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.timeout(240)]

#: Below the ephemeral range and apart from the suite's cluster (7100) and
#: tests/test_devcluster.py's (7300): killing a node here disturbs no other test.
OWN_PORTS = 7400
#: The staleness bound admission decides with (the default, set explicitly).
STALENESS_S = 30.0
TENANT_LIMIT = 25
GLOBAL_LIMIT = 80
#: Tenants of a run and their share of the admits: the first ones meet their own limit.
WEIGHTS = (4, 3, 2, 1)
#: Decided admits before the fault, and at least after the first decided one after it.
BEFORE = 15
AFTER = 30
#: How long the single Redis stays down under load.
OUTAGE_S = 3.0
#: The longest a reservation may take to be settled (503s retried meanwhile).
SETTLE_S = 45.0


# --- the stacks ---------------------------------------------------------------------------


@dataclass
class Stack:
    """A worker and two admission processes on one store, on topics and keys of their own."""

    settings: WorkerSettings
    layout: Layout
    workers: Workers
    worker: subprocess.Popen[bytes]
    metrics_port: int
    admissions: list[Process]
    urls: list[str]
    logs: Path
    #: A fresh blocking client of the store (a cluster's from every node: any may be down).
    client: Callable[[], redis.Redis]

    def stop(self) -> None:
        for proc in self.admissions:
            proc.stop()
        self.workers.stop_all()

    def log_files(self) -> list[Path]:
        return sorted(self.logs.glob("*.log"))


def _ports(count: int) -> list[int]:
    out: list[int] = []
    while len(out) < count:
        port = free_port()
        if port not in out:
            out.append(port)
    return out


def _start(
    services: Services, logs: Path, redis_url: str, *, cluster_ports: list[int] | None = None
) -> Stack:
    """Start the worker and the admission processes (not waiting for them); on the cluster
    of ``cluster_ports`` when given."""
    cluster = cluster_ports is not None
    tag = uuid.uuid4().hex[:10]
    logs.mkdir(parents=True)
    settings = WorkerSettings(
        kafka_bootstrap=services.kafka_bootstrap,
        redis_url=redis_url,
        topic_prefix=f"t{tag}.",
        redis_prefix=f"t{tag}:",
        app_id=f"t{tag}.app",
        data_dir=logs / "tables",
        metrics_port=0,
        partitions=2,
        redis_cluster=cluster,
    )
    common = {
        "SPENDGATE_REDIS_CLUSTER": "true" if cluster else "false",
        "SPENDGATE_STALENESS_S": str(STALENESS_S),
    }
    workers = Workers(settings, logs)
    metrics_port, *admission_ports = _ports(3)
    worker = workers.start(metrics_port=metrics_port, env=common)
    admissions, urls = [], []
    for i, port in enumerate(admission_ports, 1):
        env = {
            **settings_env(settings),
            **common,
            "SPENDGATE_ADMISSION_PORT": str(port),
            "SPENDGATE_POLICY_REFRESH_S": "0.1",
            # A slow answer on a loaded 2-core box is not an outage; a killed node refuses
            # connections at once, so a long timeout costs nothing here.
            "SPENDGATE_REDIS_TIMEOUT_S": "2.0",
            # Pieces of requests a dead master cut short are released within seconds
            # (the default 30 s would hold them past this test's end).
            "SPENDGATE_RESERVE_GRACE_S": "4",
            "SPENDGATE_RESERVE_SWEEP_S": "1",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("SPENDGATE_AUTH_TOKENS_FILE", None)
        admissions.append(Process(["admission"], env, logs / f"admission-{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    if cluster_ports is not None:
        nodes = [ClusterNode("127.0.0.1", port) for port in cluster_ports]

        def client() -> redis.Redis:
            return RedisCluster(startup_nodes=nodes, socket_timeout=5)  # type: ignore[return-value]
    else:

        def client() -> redis.Redis:
            return redis.Redis.from_url(redis_url, socket_timeout=5)

    layout = Layout(settings.redis_prefix, cluster=cluster)
    return Stack(settings, layout, workers, worker, metrics_port, admissions, urls, logs, client)


def _wait_answering(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    for proc, url in zip(stack.admissions, stack.urls, strict=True):
        while not proc.answers(f"{url}/healthz"):
            assert time.monotonic() < deadline, f"{proc.log.name} did not start"
            time.sleep(0.1)


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
        single = _start(services, base / "on-single", own_redis.url)
        started.append(single)
        nodes.up()
        cluster = _start(services, base / "on-cluster", nodes.url, cluster_ports=nodes.ports)
        started.append(cluster)
        _wait_answering(single)
        _wait_answering(cluster)
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


# --- the load and its ledger --------------------------------------------------------------


def _policies(run: str) -> list[Policy]:
    """Per tenant and global budgets for the admits of ``run``; roomy ones for its direct
    commits (apart: a commit produced straight to Kafka is not admitted, so it is not held
    to a limit)."""
    common = {"unit": "input_tokens", "window": "1h", "bucket": "1m"}
    direct = {"env": f"{run}-direct"}
    return [
        Policy.model_validate(
            {**common, "id": f"{run}-tenant", "match": {"env": run}, "group_by": ["tenant"],
             "limit": TENANT_LIMIT}
        ),
        Policy.model_validate(
            {**common, "id": f"{run}-global", "match": {"env": run}, "limit": GLOBAL_LIMIT}
        ),
        Policy.model_validate(
            {**common, "id": f"{run}-direct", "match": direct, "group_by": ["tenant"],
             "limit": 10**9}
        ),
        Policy.model_validate(
            {**common, "id": f"{run}-direct-all", "match": direct, "limit": 10**9}
        ),
    ]  # fmt: skip


@dataclass
class Answer:
    """One admit (monotonic times)."""

    sent: float
    answered: float
    status: int
    violated: tuple[str, ...] = ()


@dataclass
class Load:
    """Admits on both admission processes, each admitted reservation settled, and commits
    produced straight to Kafka; what was committed kept per budget key (the ledger)."""

    run: str
    stack: Stack
    http: httpx.AsyncClient
    producer: AIOKafkaProducer
    rng: random.Random
    tenants: tuple[str, ...]
    ledger: Counter[str] = field(default_factory=Counter)
    answers: list[Answer] = field(default_factory=list)
    #: request id -> (tenant, estimate) of admits answered 503: asked again, same id.
    unresolved: dict[str, tuple[str, int]] = field(default_factory=dict)
    settled: set[str] = field(default_factory=set)
    settles: list[asyncio.Task[None]] = field(default_factory=list)
    #: Reservations admission no longer knew (404) at settlement: settled through Kafka.
    lost_records: int = 0
    #: Anything a budget item, an answer or a settlement should never have shown.
    wrong: list[str] = field(default_factory=list)
    #: The body of the last 503 (why admission could not decide).
    last_503: str = ""

    @property
    def global_policy(self) -> str:
        return f"{self.run}-global"

    def subject(self, tenant: str, env: str | None = None) -> dict[str, str]:
        return {"tenant": tenant, "model": "m", "env": env or self.run}

    def admitted_keys(self, tenant: str) -> list[str]:
        return [f"{self.run}-tenant|tenant={tenant}", self.global_policy]

    def direct_keys(self, tenant: str) -> list[str]:
        return [f"{self.run}-direct|tenant={tenant}", f"{self.run}-direct-all"]

    def keys(self) -> list[str]:
        out = [self.global_policy, f"{self.run}-direct-all"]
        for tenant in self.tenants:
            out += [self.admitted_keys(tenant)[0], self.direct_keys(tenant)[0]]
        return out

    async def admit(self, url: str, request_id: str, tenant: str, estimate: int) -> int:
        sent = time.monotonic()
        try:
            reply = await self.http.post(
                f"{url}/v1/admit",
                json={
                    "request_id": request_id,
                    "subject": self.subject(tenant),
                    "estimate": {"input_tokens": estimate},
                },
            )
            status, body = reply.status_code, reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            status, body = 0, {"error": repr(exc)}
        self.answers.append(
            Answer(sent, time.monotonic(), status, tuple(body.get("violated") or ()))
        )
        if status in (200, 429):
            self.unresolved.pop(request_id, None)
        if status == 200:
            for item in body["budgets"]:
                if item["used"] + item["reserved"] > item["limit"]:
                    self.wrong.append(f"admitted over the limit: {item}")
            rid = body["reservation_id"]
            if rid not in self.settled:
                self.settled.add(rid)
                self.settles.append(asyncio.create_task(self.settle(url, rid, tenant, estimate)))
        elif status in (0, 503):
            self.unresolved[request_id] = (tenant, estimate)
            self.last_503 = str(body)[:400]
        elif status != 429:
            self.wrong.append(f"admit answered {status}: {body}")
        return status

    async def admitter(self, url: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            tenant = self.rng.choices(self.tenants, WEIGHTS)[0]
            status = await self.admit(url, uuid.uuid4().hex, tenant, self.rng.randint(1, 4))
            await asyncio.sleep(0.05 if status in (200, 429) else 0.25)

    async def settle(self, url: str, rid: str, tenant: str, estimate: int) -> None:
        """Commit (mostly the estimate, sometimes less) or release; a 503 is retried, a
        reservation admission lost (404) is settled by its event on Kafka."""
        await asyncio.sleep(self.rng.uniform(0.0, 0.3))
        roll = self.rng.random()
        actual = None if roll < 0.1 else estimate if roll < 0.8 else self.rng.randint(1, estimate)
        path = "/v1/release" if actual is None else "/v1/commit"
        body: dict[str, Any] = {"reservation_id": rid}
        if actual is not None:
            body["usage"] = {"input_tokens": actual}
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                status = (await self.http.post(f"{url}{path}", json=body)).status_code
            except httpx.HTTPError:
                status = 0
            if status == 202:
                break
            if status == 404:
                self.lost_records += 1
                await self.settle_by_kafka(rid, tenant, actual)
                break
            if status not in (0, 503) or time.monotonic() > deadline:
                self.wrong.append(f"{path} of {rid}: {status}")
                return
            await asyncio.sleep(0.2)
        for key in self.admitted_keys(tenant):
            self.ledger[key] += actual or 0

    async def settle_by_kafka(self, rid: str, tenant: str, actual: int | None) -> None:
        kind = "release" if actual is None else "commit"
        event: dict[str, Any] = {
            # admission's own event id for it: whichever copies land, it counts once
            "event_id": f"{kind}-{rid}",
            "kind": kind,
            "subject": self.subject(tenant),
            "occurred_at": datetime.now(UTC).isoformat(),
            "reservation_id": rid,
        }
        if actual is not None:
            event["usage"] = {"input_tokens": actual}
        await self.send([(tenant, event)])

    async def send(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        topic = self.stack.settings.topic("usage")
        futures = [
            await self.producer.send(topic, orjson.dumps(e), key=t.encode()) for t, e in events
        ]
        for fut in futures:
            await fut

    async def direct(self, stop: asyncio.Event) -> None:
        """Commits without a reservation, three every 0.3 s, acked before they count."""
        while not stop.is_set():
            batch = []
            for _ in range(3):
                tenant, amount = self.rng.choice(self.tenants), self.rng.randint(1, 9)
                event = {
                    "event_id": uuid.uuid4().hex,
                    "kind": "commit",
                    "subject": self.subject(tenant, f"{self.run}-direct"),
                    "occurred_at": datetime.now(UTC).isoformat(),
                    "usage": {"input_tokens": amount},
                }
                batch.append((tenant, event, amount))
            await self.send([(t, e) for t, e, _ in batch])
            for tenant, _, amount in batch:
                for key in self.direct_keys(tenant):
                    self.ledger[key] += amount
            await asyncio.sleep(0.3)

    async def resolve(self) -> None:
        """Ask every admit answered 503 again with its request id until it is decided: a
        step that held before its answer was lost hands back its reservation (settled
        then), one that held nothing is decided now."""
        deadline = time.monotonic() + SETTLE_S
        while self.unresolved:
            assert time.monotonic() < deadline, f"{len(self.unresolved)} admits undecided"
            todo = list(self.unresolved.items())[:8]
            await asyncio.gather(
                *(
                    self.admit(self.stack.urls[i % 2], rid, tenant, estimate)
                    for i, (rid, (tenant, estimate)) in enumerate(todo)
                )
            )
            if any(rid in self.unresolved for rid, _ in todo):
                await asyncio.sleep(0.2)

    def decided(self, since: float) -> list[Answer]:
        return [a for a in self.answers if a.answered >= since and a.status in (200, 429)]

    def on_global(self, a: Answer) -> bool:
        """Decided on the global budget's key: admitted, or refused by it."""
        return a.status == 200 or (a.status == 429 and self.global_policy in a.violated)

    def codes(self) -> Counter[int]:
        return Counter(a.status for a in self.answers)


@contextlib.asynccontextmanager
async def _load(run: str, stack: Stack) -> AsyncIterator[Load]:
    async with (
        httpx.AsyncClient(timeout=10) as http,
        AIOKafkaProducer(
            bootstrap_servers=stack.settings.kafka_bootstrap, enable_idempotence=True, linger_ms=5
        ) as producer,
    ):
        tenants = tuple(f"{run}-t{i}" for i in range(len(WEIGHTS)))
        yield Load(run, stack, http, producer, random.Random(derive(f"failover-{run}")), tenants)


async def _ready(load: Load) -> None:
    """Publish the run's policies; wait until both admission processes read every budget
    of every tenant as vouched for."""
    await publish_policies(load.stack.settings, _policies(load.run))

    last: list[str] = [""]

    async def vouched(url: str, tenant: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            reply = await load.http.get(f"{url}/v1/budgets", params=load.subject(tenant))
            last[0] = f"{reply.status_code} {reply.text[:500]}"
            items = reply.json().get("budgets", []) if reply.status_code == 200 else []
            return len(items) == 2 and not any(item.get("state") for item in items)
        return False

    deadline = time.monotonic() + 90
    for url in load.stack.urls:
        for tenant in load.tenants:
            while not await vouched(url, tenant):
                assert time.monotonic() < deadline, (
                    f"budgets of {tenant} not vouched on {url}: {last[0]}"
                )
                await asyncio.sleep(0.2)


@dataclass
class Fault:
    """Breaks the store (returns when), then waits until it serves again (returns when)."""

    name: str
    inject: Callable[[Load], Awaitable[float]]
    recover: Callable[[Load], Awaitable[float]]


def _crash(stack: Stack) -> str | None:
    """Why the worker is gone (the first crash line of its log), or None while it runs."""
    if stack.worker.poll() is None:
        return None
    lines = (stack.logs / "worker-w1.log").read_text(errors="replace").splitlines()
    crashed = [ln for ln in lines if "Crashed" in ln] or lines[-3:]
    return f"the worker exited ({stack.worker.returncode}): {crashed[0]}"


async def _until(stack: Stack, check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """:func:`eventually`, failing at once (saying why) when the worker has died."""

    def alive_and(check: Callable[[], bool]) -> bool:
        crash = _crash(stack)
        assert crash is None, f"{what}: {crash}"
        return check()

    await eventually(lambda: alive_and(check), timeout_s, what)


async def _ride_through(load: Load, fault: Fault) -> dict[str, Any]:
    """The load around one fault, then every assertion of the issue; returns the figures."""
    stack = load.stack
    await _ready(load)
    errors_before = metric(stack.metrics_port, "spendgate_worker_store_errors_total")
    stop = asyncio.Event()
    started = time.monotonic()
    tasks = [asyncio.create_task(load.admitter(url, stop)) for url in stack.urls * 2]
    tasks.append(asyncio.create_task(load.direct(stop)))
    try:
        await _until(
            stack,
            lambda: len(load.decided(started)) >= BEFORE and time.monotonic() - started > 1.5,
            30,
            "admits decided before the fault",
        )
        broken = await fault.inject(load)
        back = await fault.recover(load)
        try:
            await _until(
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

        await _until(stack, enough, 30, "the load meeting both limits after the recovery")
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    await load.resolve()
    await asyncio.gather(*load.settles)
    load_s = time.monotonic() - started

    # The windows equal the ledger once the worker caught up: nothing lost, nothing twice.
    keys = load.keys()
    policies = {p.id: p for p in _policies(load.run)}
    client = stack.client()

    def windows() -> dict[str, int]:
        out = {}
        for key in keys:
            shard = stack.layout.of_key(policies[key.split("|")[0]], key)
            out[key] = window_sum(client, shard, key)
        return out

    def pending() -> dict[str, int]:
        out = {}
        for key in keys[:1] + [k for k in keys if "-tenant|" in k]:
            shard = stack.layout.of_key(policies[key.split("|")[0]], key)
            if isinstance(client, RedisCluster):
                node = client.get_node_from_key(window_key(shard, key))
                with redis.Redis(host=node.host, port=node.port) as conn:
                    out[key] = held.pending_sum(conn, shard, key)
            else:
                out[key] = held.pending_sum(client, shard, key)
        return {k: v for k, v in out.items() if v}

    expected = {key: load.ledger[key] for key in keys}

    def converged() -> bool:
        try:
            return windows() == expected and not pending()
        except (redis.RedisError, OSError):
            return False

    try:
        await _until(stack, converged, 45, "windows equal to the ledger, nothing pending")
    except AssertionError:
        if _crash(stack) is not None:
            raise
        got, left = windows(), pending()
        diff = {k: (expected[k], got[k]) for k in keys if expected[k] != got[k]}
        raise AssertionError(
            f"{fault.name}: windows differ from the ledger (key: (ledger, window)) {diff}; "
            f"still pending {left}; seed label failover-{load.run}"
        ) from None
    finally:
        client.close()
    caught_up_s = time.monotonic() - started - load_s

    # No budget over its limit, and the limits were met (429s).
    limits = {f"{load.run}-tenant": TENANT_LIMIT, load.global_policy: GLOBAL_LIMIT}
    for key in keys:
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
    assert _crash(stack) is None, _crash(stack)
    _no_crash(stack)
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


def _no_crash(stack: Stack) -> None:
    lines = (stack.logs / "worker-w1.log").read_text(errors="replace").splitlines()
    bad = [i for i, ln in enumerate(lines) if "Crashed" in ln or "Traceback" in ln]
    assert not bad, "the worker's log shows a crash:\n" + "\n".join(lines[bad[0] : bad[0] + 40])


def _report(figures: dict[str, Any]) -> None:
    ledger = figures.pop("ledger")
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    print("  ledger == window:", ", ".join(f"{k}={v}" for k, v in sorted(ledger.items())))


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.usefixtures("show_logs")
class TestStoreFailover:
    async def test_kill_9_of_a_master_three_times_in_a_row(self, stacks: Stacks) -> None:
        stack, nodes = stacks.cluster, stacks.nodes
        wall = time.monotonic()
        killed: dict[str, Any] = {}

        async def kill_the_global_master(load: Load) -> float:
            policy = next(p for p in _policies(load.run) if p.id == load.global_policy)
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
            async with _load(run, stack) as load:
                try:
                    figures = await _ride_through(load, fault)
                finally:
                    await asyncio.to_thread(healed, nodes)
            print(f"\n{run}: killed master {killed['port']}")
            _report(figures)
        _no_crash(stack)
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

        async with _load("s1", stack) as load:
            figures = await _ride_through(load, Fault("single Redis restarted", stop, start))
        assert figures["worker_store_errors"] > 0, "the outage never reached the worker"
        print("\ns1: single Redis restarted")
        _report(figures)
        _no_crash(stack)
        print(f"single Redis: {time.monotonic() - wall:.1f} s wall")
