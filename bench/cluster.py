"""Admission on a Redis Cluster: what a request costs on its home shard and across shards,
and the ceiling of a budget every request touches.

On the project's loopback cluster (``spendgate dev cluster``: 3 masters, one replica each;
started by this command when it is not running, and stopped after), through the admission
store as the service calls it (``BudgetStore.admit``, no HTTP), sequentially:

* **baseline**: ``EVALSHA`` of a script returning 1 on the shared budget's master, and the
  same followed by ``WAIT 1`` on its connection (what a durable step adds);
* **home shard**: requests matching one budget grouped by tenant (one ADMIT on the
  tenant's shard);
* **across shards**: the same plus one budget grouped by model, which every request
  touches (its own shard; the request runs the piece protocol: answer lookup, a piece per
  shard, SEAL, unlist);

each with ``WAIT`` for one replica (the default) and without. Figures: client-side
latency per admit (p50, p99), Redis round trips per admit (every send of this
process's connections, a pipelined batch once), the masters' time in scripts per admit
(``INFO commandstats`` of EVALSHA and EVAL), the masters' CPU per admit (their processes'
``used_cpu_user + used_cpu_sys`` delta over the admits, net of each one's idle rate
measured just before, INFO cpu) and **the shared budget's master's CPU per admit**: one
Redis runs on one thread, so ``1e6 / CPU µs per admit`` is the ceiling, in admits per
second, of every request that touches that one key, however many masters the cluster
has. The checks: every admit answered 200, and the shared key holds exactly the admitted
count.

Throughput of one master against three on this 2-core machine would measure nothing (the
client and all six servers share two cores), so none is reported.

Run: ``.venv/bin/python -m bench.cluster`` (``--requests N``, ``--smoke``, ``--check``,
``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

from bench._common import (
    add_check_flag,
    exit_status,
    pct,
    print_header,
    print_table,
    run_id,
    verdict,
)
from spendgate.admission.plans import Planner
from spendgate.admission.server import budget_store, redis_client
from spendgate.admission.settings import AdmissionSettings
from spendgate.devcluster import ClusterSettings, LocalCluster
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.layout import Layout, shard_of
from spendgate.schemas.luascript import LuaScript
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import pending_total_key, pending_window_key
from spendgate.schemas.shards import Topology
from spendgate.schemas.window_codec import PENDING_TOTAL_FIELD
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.fold import KeyWrite
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer

TOPOLOGY = Topology(usage=4, keyed=4)
VOUCHED = 2**52
MODEL = "m1"
SHARED_KEY = f"per-model|model={MODEL}"
NOOP = LuaScript("bench:noop", "return 1")


def _policies(requests: int) -> list[Policy]:
    common = {"unit": "requests", "window": "1h", "limit": 10 * requests}
    return [
        Policy.model_validate({"id": "per-tenant", "group_by": ["tenant"], **common}),
        Policy.model_validate({"id": "per-model", "group_by": ["model"], **common}),
    ]


def _tenants(count: int) -> list[str]:
    """Tenants whose home shard is not the shared key's (so every request spans two)."""
    shared = shard_of(SHARED_KEY)
    return [t for t in (f"team-{i}" for i in range(10 * count)) if shard_of(t) != shared][:count]


#: Writes this process sent to Redis (each one round trip: a pipelined batch is one).
SENT = [0]


def _count_round_trips() -> None:
    """Count every send of redis-py's asyncio connections in this process."""
    from redis.asyncio.connection import Connection

    send = Connection.send_packed_command

    async def counted(self: Connection, *args: Any, **kwargs: Any) -> None:
        SENT[0] += 1
        await send(self, *args, **kwargs)

    Connection.send_packed_command = counted  # type: ignore[method-assign]


async def _stats(client: Any) -> tuple[int, dict[str, tuple[float, float]]]:
    """Round trips sent so far, and each master's (command µs from commandstats, process
    CPU s from INFO cpu) by address (the reads themselves are not counted)."""
    sent = SENT[0]
    cpu: dict[str, tuple[float, float]] = {}
    for node in client.get_primaries():
        stats = await client.info("commandstats", target_nodes=node)
        # The scripts' own time (a command a script runs is counted in it and again
        # under its own name: only the scripts are summed).
        usec = sum(float(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in ("evalsha", "eval"))
        info = await client.info("cpu", target_nodes=node)
        cpu[node.name] = (usec, float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    SENT[0] = sent
    return sent, cpu


async def _windows(client: Any, layout: Layout, policies: list[Policy], tenants: list[str]) -> None:
    """Every key's window as the worker writes it (version 2, one bucket), so admits read
    it in O(1) as in production."""
    by_id = {p.id: p for p in policies}
    materializer = RedisMaterializer(
        client, layout.prefix, limit_of=lambda pid: by_id[pid].limit, layout=layout,
        policy_of=by_id.get,
    )  # fmt: skip
    now_ms = int(time.time() * 1000)
    keys = [f"per-tenant|tenant={t}" for t in tenants]
    if "per-model" in by_id:
        keys.append(SHARED_KEY)
    writes = []
    for key in keys:
        state = KeyState(buckets={now_ms // 60_000 * 60_000: 1}, bucket_ms=60_000,
                         window_ms=3_600_000)  # fmt: skip
        state.high_ms = now_ms
        state.offsets = {0: 1}
        writes.append(KeyWrite(key, state, WindowSpec(3_600_000, 60_000), True, True))
    await materializer.write_batch(writes)


async def _baseline(client: Any, node: Any, n: int, wait: bool) -> list[float]:
    from redis.asyncio.cluster import PipelineCommand

    key = "bench:{s0}noop"
    out = []
    for _ in range(n):
        calls = [PipelineCommand(0, "EVAL", NOOP.source, 1, key)]
        if wait:
            calls.append(PipelineCommand(1, "WAIT", 1, 100))
        started = time.perf_counter()
        await node.execute_pipeline(calls)
        out.append(time.perf_counter() - started)
    return out


async def _run(cluster_url: str, requests: int, wait: bool, across: bool) -> dict[str, Any]:
    prefix = run_id("cluster").rstrip(".") + ":"
    settings = AdmissionSettings(
        redis_url=cluster_url,
        redis_cluster=True,
        redis_prefix=prefix,
        redis_timeout_s=5.0,
        redis_wait_replicas=1 if wait else 0,
    )
    client: Any = redis_client(settings)
    await client.initialize()
    store = budget_store(settings, client)
    layout = Layout(prefix, cluster=True)
    policies = _policies(requests) if across else _policies(requests)[:1]
    try:
        await RedisMaterializer(
            client, prefix, limit_of=lambda _: None, layout=layout,
            policy_of={p.id: p for p in policies}.get,
        ).stand_in(policies, TOPOLOGY, VOUCHED)  # fmt: skip
        tenants = _tenants(16)
        await _windows(client, layout, policies, tenants)
        planner = Planner(await store.policies(), None)
        plans = {
            t: planner.plans(Subject(tenant=t, model=MODEL), Usage(requests=1)) for t in tenants
        }
        shared_shard = layout.shard(shard_of(SHARED_KEY))
        shared_node = client.get_node_from_key(pending_total_key(shared_shard, SHARED_KEY))
        # The master's own CPU while idle (cluster bus, cron), subtracted below.
        _, idle_before = await _stats(client)
        idle_started = time.perf_counter()
        await asyncio.sleep(1.0)
        _, idle_after = await _stats(client)
        idle_s = time.perf_counter() - idle_started
        idle_rate = {n: (idle_after[n][1] - idle_before[n][1]) / idle_s for n in idle_after}
        calls_before, cpu_before = await _stats(client)
        run_started = time.perf_counter()
        latencies, admitted = [], 0
        for i in range(requests):
            tenant = tenants[i % len(tenants)]
            started = time.perf_counter()
            result = await store.admit(uuid.uuid4().hex, uuid.uuid4().hex, plans[tenant], 0)
            latencies.append(time.perf_counter() - started)
            admitted += result.outcome == "allow"
        run_s = time.perf_counter() - run_started
        calls_after, cpu_after = await _stats(client)
        held = None
        if across:
            shard = layout.shard(shard_of(SHARED_KEY))
            # The pending windows of both versions (version 1 while no worker wrote one).
            v1 = await client.hvals(pending_window_key(shard, SHARED_KEY))
            total = await client.hget(pending_total_key(shard, SHARED_KEY), PENDING_TOTAL_FIELD)
            held = sum(int(v) for v in v1) + int(total or 0)
        stats_calls = 0

        def per_admit(names: list[str]) -> tuple[float, float]:
            """Scripts µs and CPU µs (net of idle) per admit over these masters."""
            scripts = sum(cpu_after[n][0] - cpu_before[n][0] for n in names)
            busy = sum(cpu_after[n][1] - cpu_before[n][1] - idle_rate[n] * run_s for n in names)
            return scripts / requests, max(0.0, busy) * 1e6 / requests

        command_us, cpu_us = per_admit(list(cpu_after))
        _, shared_cpu_us = per_admit([shared_node.name])
        baseline = await _baseline(client, shared_node, requests, wait)
        return {
            "latencies": latencies,
            "admitted": admitted,
            "held": held,
            "calls": (calls_after - calls_before - stats_calls) / requests,
            "cpu_us": cpu_us,
            "command_us": command_us,
            "shared_cpu_us": shared_cpu_us,
            "baseline": baseline,
        }
    finally:
        async for key in client.scan_iter(match=f"{prefix}*", count=1000):
            await client.delete(key)
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="admits per case")
    ap.add_argument("--smoke", action="store_true", help="a tiny run (CI)")
    add_check_flag(ap)
    args = ap.parse_args(argv)
    requests = 60 if args.smoke else args.requests
    _count_round_trips()
    nodes = LocalCluster(ClusterSettings())
    was_running = all(s.running for s in nodes.status())
    nodes.up()
    print_header("bench.cluster: admission on a Redis Cluster", {"requests": requests})
    rows = []
    ok = True
    try:
        for wait in (True, False):
            for across in (False, True):
                r = asyncio.run(_run(nodes.url, requests, wait, across))
                lat, base = r["latencies"], r["baseline"]
                exact = r["admitted"] == requests and (not across or r["held"] == requests)
                if not exact:
                    print(f"admitted {r['admitted']} of {requests}, shared key holds {r['held']}")
                ok &= exact
                rows.append(
                    [
                        "across shards" if across else "home shard",
                        "WAIT 1" if wait else "no WAIT",
                        pct(lat, 50) * 1e6,
                        pct(lat, 99) * 1e6,
                        pct(base, 50) * 1e6,
                        r["calls"],
                        r["command_us"],
                        r["cpu_us"],
                        r["shared_cpu_us"] if across else float("nan"),
                        1e6 / r["shared_cpu_us"]
                        if across and r["shared_cpu_us"] > 0
                        else float("nan"),
                    ]
                )
    finally:
        if was_running:
            nodes.detach()
        else:
            nodes.down()
    print_table(
        [
            "requests",
            "durability",
            "p50 us/admit",
            "p99 us/admit",
            "baseline p50 us (EVAL noop on the shared master, same WAIT)",
            "Redis round trips/admit",
            "scripts us/admit (all masters)",
            "CPU us/admit (all masters, net of idle)",
            "shared key's master: CPU us/admit",
            "ceiling admits/s through the shared key",
        ],
        rows,
    )
    print(f"every admit answered and the shared key holds exactly them: {verdict(ok, 'exact')}")
    return exit_status(args.check)


if __name__ == "__main__":
    sys.exit(main())
