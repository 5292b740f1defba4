"""Paired A/B of two checkouts' admission servers: is this one's admit path slower?

Throughput on a shared 2-core machine moves 10-25% between runs of the same code, so
comparing two runs cannot show a 5% change. Here both servers run at once, each from its
own checkout (its own venv, code and key prefix, prepared by its own
``bench.admission --prepare``), and one load generator sends each request pair to both,
alternating which goes first: both see the same machine at the same moment. Figures per
server: its CPU time per request (``/proc/<pid>/stat``, user + system, every thread) and
latency, for requests a 1-budget ``reject`` policy admits and for requests it refuses
(its window already over the limit). Each round is judged on its own; the report gives
every round's ratio and their median.

Each server runs its own checkout's code: ``spendgate`` first on its ``sys.path`` through a
tree of links (``bench._common.namespace_tree``), checked before measuring (an editable
install maps ``spendgate.admission`` to one checkout, whatever the working directory).
The other checkout needs this ``bench/admission.py`` (for ``--prepare``): copy it in when
it predates it. Run: ``.venv/bin/python -m bench.admission_ab --against ../old-checkout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import _common as c
from bench._http import Conn, post
from bench.admission import ESTIMATE, REFUSED_MODEL, _absorb, _cpu_s

TENANTS = 500
PHASES = (("admitted", "m1", "200"), ("refused", REFUSED_MODEL, "429"))


@dataclass
class Side:
    """One checkout's admission server."""

    name: str
    root: Path
    rid: str
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    latencies: list[float] = field(default_factory=list)

    @property
    def python(self) -> str:
        return str(self.root / ".venv" / "bin" / "python")

    def env(self) -> dict[str, str]:
        return {
            "SPENDGATE_KAFKA_BOOTSTRAP": c.KAFKA,
            "SPENDGATE_REDIS_URL": c.REDIS,
            "SPENDGATE_TOPIC_PREFIX": f"{self.rid}.",
            "SPENDGATE_REDIS_PREFIX": f"{self.rid}:",
            "SPENDGATE_ADMISSION_PORT": str(self.port),
        }

    def git(self) -> str:
        return c.checkout_label(self.root)

    def own_code(self, tmp: Path) -> tuple[dict[str, str], Path]:
        """The environment and working directory that run this checkout's ``spendgate``
        (checked: the admission app it imports is this checkout's file)."""
        links = c.namespace_tree(self.root, tmp / "code" / self.name)
        env = {**self.env(), "PYTHONPATH": str(links)}
        probe = "import os, spendgate.admission.app as a; print(os.path.realpath(a.__file__))"
        done = subprocess.run(
            [self.python, "-c", probe],
            cwd=links,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        imported = done.stdout.strip()
        if not imported.startswith(str(self.root.resolve()) + os.sep):
            raise SystemExit(f"the {self.name} server would import {imported}, not {self.root}")
        return env, links


async def _round(
    sides: list[Side], model: str, expect: str, seconds: float, connections: int, tag: str
) -> dict[str, dict[str, float]]:
    """Closed loop for ``seconds``: each connection pair sends one request to each side in
    turn (who goes first alternates); CPU per request and latencies per side."""
    est = json.dumps(ESTIMATE, separators=(",", ":"))
    conns = [[await Conn.open("127.0.0.1", s.port) for s in sides] for _ in range(connections)]
    sent = [0] * len(sides)
    wrong: dict[str, int] = {}
    lat: list[list[float]] = [[] for _ in sides]

    async def one(k: int, conn: Conn, i: int, record: bool) -> None:
        body = (
            f'{{"request_id":"{tag}-{k}-{i}","subject":{{"tenant":"t{i % TENANTS}",'
            f'"model":"{model}"}},"estimate":{est}}}'
        ).encode()
        t0 = time.perf_counter()
        status, _ = await conn.request(post("/v1/admit", body))
        if record:
            lat[k].append(time.perf_counter() - t0)
            sent[k] += 1
        if str(status) != expect:
            wrong[sides[k].name] = wrong.get(sides[k].name, 0) + 1

    async def pair(j: int, i: int, record: bool) -> None:
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            await one(k, conns[j][k], j * 1_000_000 + i, record)

    async def warm_up(j: int) -> None:  # not recorded: connections, script cache, first paths
        for i in range(50):
            await pair(j, i, False)

    async def measure(j: int, deadline: float) -> None:
        i = 50
        while time.perf_counter() < deadline:
            await pair(j, i, True)
            i += 1

    await asyncio.gather(*(warm_up(j) for j in range(connections)))
    cpu0 = [_cpu_s(s.proc.pid) for s in sides if s.proc is not None]
    deadline = time.perf_counter() + seconds
    await asyncio.gather(*(measure(j, deadline) for j in range(connections)))
    cpu1 = [_cpu_s(s.proc.pid) for s in sides if s.proc is not None]
    for pair_conns in conns:
        for conn in pair_conns:
            conn.close()
    if wrong:
        raise RuntimeError(f"unexpected statuses (wanted {expect}): {wrong}")
    return {
        s.name: {
            "n": sent[k],
            "cpu_us": 1e6 * (cpu1[k] - cpu0[k]) / sent[k],
            "p50_ms": 1e3 * c.pct(lat[k], 50),
            "p99_ms": 1e3 * c.pct(lat[k], 99),
        }
        for k, s in enumerate(sides)
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.admission_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the other checkout (with its .venv)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per phase")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per round")
    ap.add_argument("--connections", type=int, default=1, help="connection pairs")
    ap.add_argument("--smoke", action="store_true", help="one short round (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.seconds = 1, 0.5
    rid = c.run_id("ab")
    sides = [
        Side("this", c.ROOT, f"{rid}t", c.free_port()),
        Side("against", Path(args.against).resolve(), f"{rid}a", c.free_port()),
    ]
    c.print_header(
        "admission A/B (both servers at once, requests alternated)",
        {
            "this": f"{sides[0].root} ({sides[0].git()})",
            "against": f"{sides[1].root} ({sides[1].git()})",
            "rounds": args.rounds,
            "seconds_per_round": args.seconds,
            "connection_pairs": args.connections,
            "policy": "1 budget, on_exceed reject, 1h/1m, 60 dense buckets per key",
        },
    )
    tmp = Path(f"/tmp/{rid}")
    results: dict[str, list[dict[str, dict[str, float]]]] = {p: [] for p, _, _ in PHASES}
    try:
        for s in sides:
            subprocess.run(
                [s.python, "-m", "bench.admission", "--prepare", s.rid, "--budgets", "1"],
                cwd=s.root,
                check=True,
                env={**os.environ, **s.env()},
            )
        with contextlib.ExitStack() as stack:
            for s in sides:
                env, cwd = s.own_code(tmp)
                s.proc = stack.enter_context(
                    c.process(
                        [s.python, "-m", "spendgate", "admission"],
                        env,
                        tmp / f"{s.name}.log",
                        cwd=cwd,
                    )
                )
            for s in sides:
                c.wait_http(s.port, "/readyz")
            for r in range(args.rounds):
                for phase, model, expect in PHASES:
                    got = asyncio.run(
                        _round(sides, model, expect, args.seconds, args.connections, f"{rid}r{r}")
                    )
                    results[phase].append(got)
                    for s in sides:  # as a worker would absorb them: runs stay alike
                        _absorb(s.rid)
                    print(
                        f"  round {r + 1} {phase:8s} this {got['this']['cpu_us']:7,.0f} us/req "
                        f"against {got['against']['cpu_us']:7,.0f} us/req "
                        f"(n={got['this']['n']:,})",
                        flush=True,
                    )
    finally:
        for s in sides:
            c.delete_redis_prefix(c.REDIS, f"{s.rid}:")
            c.delete_topics(c.KAFKA, f"{s.rid}.")
    print()
    rows = []
    for phase, _, _ in PHASES:
        rounds = results[phase]
        ratios = [g["this"]["cpu_us"] / g["against"]["cpu_us"] for g in rounds]
        for name in ("this", "against"):
            cpu = [g[name]["cpu_us"] for g in rounds]
            rows.append(
                [
                    phase,
                    name,
                    sum(int(g[name]["n"]) for g in rounds),
                    statistics.median(cpu),
                    f"{min(cpu):,.0f}-{max(cpu):,.0f}",
                    statistics.median(g[name]["p50_ms"] for g in rounds),
                    statistics.median(g[name]["p99_ms"] for g in rounds),
                    "" if name == "against" else f"{statistics.median(ratios):.3f}",
                    "" if name == "against" else f"{min(ratios):.3f}-{max(ratios):.3f}",
                ]
            )
    c.print_table(
        [
            "requests",
            "server",
            "n",
            "CPU us/req (median)",
            "range",
            "p50 ms",
            "p99 ms",
            "this/against CPU",
            "per-round ratios",
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
