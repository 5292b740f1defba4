"""Paired A/B of two checkouts' ADMIT scripts in Redis: is this one's Lua slower?

Each checkout builds its own calls with its own code, so the two may lay out KEYS and
ARGV differently (a target's keys, say): a helper process per checkout (this module's
``--serve``, run with that checkout's ``spendgate`` first on ``sys.path`` through a tree
of links, ``bench._common.namespace_tree``; the modules it imported are checked to be
that checkout's) hands over its ADMIT script, the KEYS and ARGV of each case's calls as
its own ``BudgetStore.admit`` builds them (a stand-in client records the command instead
of sending it), and the prefill of its own keys (its own prefix) written with its own
``window_codec.encode``. Both scripts run on the same Redis. Each round runs a block of
calls of one checkout, then of the other (which goes first alternates), each on its own
keys rewritten just before (the prefix emptied, the prefill written again), and reads
Redis's own time for each block from ``INFO commandstats`` (``cmdstat_evalsha``: nothing
else runs scripts meanwhile). Figures: Redis microseconds per call, per checkout, for
windows of 1 h and 24 h in 1 min buckets (``--windows``: also 1 m in 1 s buckets and
31 d in 1 h buckets) prefilled dense (every bucket of the window non-empty, 100 each),
1 and 5 budgets, admitted (limits far above the usage) and refused (the usage already
over), beside a bare ``EVALSHA`` of ``return 1`` measured in the same rounds (the floor
of any script call). Before measuring a case, the first call of each checkout on a fresh
prefill of the same instant must decide alike: outcome, Retry-After and each target's
used, reserved, own, violated, reset-after and state, as each checkout's own reply
decoder reads them (instants compared, not the waits measured from each call's own now).

"new" is this checkout, "old" the one given with ``--against`` (a checkout or a
``git worktree``; no venv of its own needed: this interpreter runs both).
Run: ``.venv/bin/python -m bench.admit_script_ab --against ../old-checkout``.

This module is also the helper (``--serve``): it imports nothing of ``spendgate`` at the
top, so the helper's ``spendgate`` is the one its ``sys.path`` finds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import _common as c

#: label -> (window, bucket, window ms, bucket ms).
WINDOWS = {
    "1m": ("1m", "1s", 60_000, 1_000),
    "1h": ("1h", "1m", 3_600_000, 60_000),
    "24h": ("24h", "1m", 86_400_000, 60_000),
    "31d": ("31d", "1h", 2_678_400_000, 3_600_000),
}
BARE = "return 1"
#: The decision entries compared (per target: ``KEYS_COMPARED``).
KEYS_COMPARED = ("used", "reserved", "own", "violated", "reset_at", "state")


@dataclass(frozen=True)
class Case:
    window: str
    budgets: int
    phase: str  # admitted | refused

    @property
    def bucket_ms(self) -> int:
        return WINDOWS[self.window][3]

    @property
    def label(self) -> str:
        window, bucket = WINDOWS[self.window][:2]
        return f"{window} / {bucket}"

    def request(self, prefix: str, now_ms: int, calls: int) -> dict[str, Any]:
        window, bucket, window_ms, bucket_ms = WINDOWS[self.window]
        return {
            "op": "case",
            "prefix": prefix,
            "window": window,
            "bucket": bucket,
            "window_ms": window_ms,
            "bucket_ms": bucket_ms,
            "budgets": self.budgets,
            "phase": self.phase,
            "now_ms": now_ms,
            "calls": calls,
        }


# --------------------------------------------------------------------------- helper side


class _Captured(Exception):
    """Not an error: how the stand-in client stops a call it recorded."""

    def __init__(self, command: list[str]) -> None:
        super().__init__("captured")
        self.command = command


def _unpack(packed: Any) -> list[str]:
    """The arguments of one RESP array of bulk strings (what ``resp.pack`` builds)."""
    data = b"".join(packed) if isinstance(packed, list | tuple) else bytes(packed)
    if not data.startswith(b"*"):
        raise ValueError(f"not a RESP array: {data[:40]!r}")
    end = data.index(b"\r\n")
    count, at, out = int(data[1:end]), end + 2, []
    for _ in range(count):
        end = data.index(b"\r\n", at)
        size = int(data[at + 1 : end])
        out.append(data[end + 2 : end + 2 + size].decode())
        at = end + 4 + size
    return out


class _Connection:
    async def send_packed_command(self, packed: Any, *_: Any, **__: Any) -> None:
        raise _Captured(_unpack(packed))

    async def read_response(self, *_: Any, **__: Any) -> Any:
        raise AssertionError("a captured command has no reply")


class _Pool:
    async def get_connection(self, *_: Any, **__: Any) -> _Connection:
        return _Connection()

    async def release(self, *_: Any, **__: Any) -> None:
        return None


class _CaptureClient:
    """Stands in for a redis-py asyncio client: the first command the store sends (on a
    pooled connection, or as ``evalsha``/``execute_command``) is recorded and fails with
    :class:`_Captured`, never sent."""

    connection_pool = _Pool()

    def register_script(self, source: str) -> object:
        return object()

    async def evalsha(self, *args: Any) -> Any:
        raise _Captured(["EVALSHA", *(str(a) for a in args)])

    async def execute_command(self, *args: Any, **_: Any) -> Any:
        raise _Captured([a.decode() if isinstance(a, bytes) else str(a) for a in args])


def _serve() -> None:
    """Answer one JSON request per stdin line with this process's ``spendgate``."""
    import spendgate
    import spendgate.admission
    import spendgate.schemas
    from spendgate.admission import store as store_module
    from spendgate.admission.app import build_plans
    from spendgate.admission.scripts import admit
    from spendgate.admission.scripts.admit import AdmitResult
    from spendgate.admission.store import BudgetStore
    from spendgate.schemas import window_codec
    from spendgate.schemas.events import Subject, Usage
    from spendgate.schemas.policies import Policy
    from spendgate.schemas.redis_keys import marks_key, window_key
    from spendgate.schemas.shards import Topology

    topology = Topology(usage=4, keyed=4)
    modules = (spendgate, spendgate.schemas, spendgate.admission, store_module, window_codec)

    async def case(req: dict[str, Any]) -> dict[str, Any]:
        window_ms, bucket_ms, budgets = req["window_ms"], req["bucket_ms"], req["budgets"]
        used = 100 * (window_ms // bucket_ms)
        limit = used * 1000 if req["phase"] == "admitted" else used // 2
        model = f"m{budgets}"
        policies = [
            Policy.model_validate(
                {
                    "id": f"ab{j}",
                    "match": {"model": model},
                    "group_by": ["tenant"],
                    "unit": "total_tokens",
                    "limit": limit,
                    "window": req["window"],
                    "bucket": req["bucket"],
                }
            )
            for j in range(budgets)
        ]
        plans = build_plans(
            policies, Subject(tenant="t", model=model), Usage(output_tokens=10), None
        )
        keys = [charge.target.key for charge in plans[0].charges]
        assert len(keys) == budgets, f"{len(keys)} targets, wanted {budgets}"
        store = BudgetStore(_CaptureClient(), req["prefix"], 3600.0)  # type: ignore[arg-type]
        store.topology = topology
        calls = []
        for _ in range(req["calls"]):
            rid = uuid.uuid4().hex
            try:
                await store.admit(rid, rid, plans, 10)
            except _Captured as captured:
                command = captured.command
            else:
                raise RuntimeError("BudgetStore.admit sent nothing")
            if command[0].upper() != "EVALSHA":
                raise RuntimeError(f"BudgetStore.admit sent {command[0]}, not EVALSHA")
            n = int(command[2])
            calls.append([command[1], command[3 : 3 + n], command[3 + n :]])
        now = req["now_ms"]
        head = now - now % bucket_ms
        value = window_codec.encode(
            {head - k * bucket_ms: 100 for k in range(window_ms // bucket_ms)}, bucket_ms
        )
        prefill: list[list[Any]] = [
            ["set", window_key(req["prefix"], k), value.hex()] for k in keys
        ]
        marks = dict.fromkeys(topology.all_marks(), str(2**52))
        prefill.append(["hset", marks_key(req["prefix"]), marks])
        return {"calls": calls, "prefill": prefill}

    def decode(reply: list[Any]) -> dict[str, Any]:
        r = AdmitResult.decode(reply)
        return {
            "outcome": r.outcome,
            "now_ms": r.now_ms,
            "retry_after_ms": r.retry_after_ms,
            "never_fits": r.never_fits,
            "keys": [
                {
                    "used": k.used,
                    "reserved": k.reserved,
                    "own": k.own,
                    "violated": k.violated,
                    "reset_after_ms": k.reset_after_ms,
                    "state": k.state,
                }
                for k in r.keys
            ],
        }

    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "hello":
                out: dict[str, Any] = {
                    "files": [os.path.realpath(str(m.__file__)) for m in modules],
                    "source": admit.SCRIPT.source,
                    "sha": admit.SCRIPT.sha,
                }
            elif req["op"] == "case":
                out = asyncio.run(case(req))
            elif req["op"] == "decode":
                out = decode(req["reply"])
            else:
                raise ValueError(f"unknown op {req['op']!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails
            import traceback

            out = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------- parent side


@dataclass
class Side:
    """One checkout: its helper process, its keys' prefix, its script."""

    name: str  # new | old
    root: Path
    prefix: str
    proc: subprocess.Popen[str] | None = None
    sha: str = ""
    files: list[str] = field(default_factory=list)

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} checkout's helper ({self.root}) died")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise SystemExit(
                f"the {self.name} checkout's helper ({self.root}) failed: {out['error']}"
            )
        return out

    def git(self) -> str:
        return c.checkout_label(self.root)


def _start(side: Side, stack: ExitStack, tmp: Path, client: Any) -> None:
    """Start the side's helper on its own code and check which code it imported."""
    links = c.namespace_tree(side.root, tmp / side.name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(links), str(c.ROOT)])}
    argv = [sys.executable, "-m", "bench.admit_script_ab", "--serve"]
    side.proc = stack.enter_context(c.piped(argv, env, cwd=links))
    hello = side.ask(op="hello")
    side.files = hello["files"]
    root = str(side.root.resolve()) + os.sep
    wrong = [f for f in side.files if not f.startswith(root)]
    if wrong:
        raise SystemExit(
            f"the {side.name} checkout's helper imported {wrong}, not code from {side.root}"
        )
    side.sha = client.script_load(hello["source"])
    if side.sha != hello["sha"]:
        raise SystemExit(f"{side.name}: Redis names the script {side.sha}, not {hello['sha']}")


def _fresh(client: Any, side: Side, prefill: list[list[Any]]) -> None:
    """Empty the side's prefix (whatever its scripts wrote) and write its prefill."""
    c.delete_redis_prefix(c.REDIS, side.prefix)
    pipe = client.pipeline(transaction=False)
    for op, key, value in prefill:
        if op == "set":
            pipe.set(key, bytes.fromhex(value), px=3_600_000)
        elif op == "hset":
            pipe.hset(key, mapping=value)
            pipe.pexpire(key, 3_600_000)
        else:
            raise ValueError(f"unknown prefill op {op!r}")
    pipe.execute()


def _usec(client: Any) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("usec", 0)), int(stats.get("calls", 0))


def _block(client: Any, sha: str, calls: list[list[Any]], tries: int = 3) -> float:
    """Redis us per call of ``calls`` (``[sha, keys, args]``) run through ``sha``, in
    pipelines of 50; a block in which another client ran a script too is measured again
    (``tries`` times at most)."""
    for _ in range(tries):
        before, n0 = _usec(client)
        for first in range(0, len(calls), 50):
            pipe = client.pipeline(transaction=False)
            for _sha, keys, args in calls[first : first + 50]:
                pipe.evalsha(sha, len(keys), *keys, *args)
            pipe.execute()
        after, n1 = _usec(client)
        if n1 - n0 == len(calls):
            return (after - before) / len(calls)
    raise RuntimeError(f"another client kept running scripts during {tries} blocks")


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


def _decision(decoded: dict[str, Any]) -> dict[str, Any]:
    """What both checkouts must agree on; waits become instants (each call has its own
    now), so two calls made a few ms apart in the same bucket compare equal."""
    now = decoded["now_ms"]

    def at(wait: int | None) -> int | None:
        return now + wait if wait is not None and wait > 0 else wait

    return {
        "outcome": decoded["outcome"],
        "retry_at": at(decoded["retry_after_ms"]),
        "never_fits": decoded["never_fits"],
        "keys": [
            {
                **{k: key[k] for k in KEYS_COMPARED if k != "reset_at"},
                "reset_at": at(key["reset_after_ms"]),
            }
            for key in decoded["keys"]
        ],
    }


def _check_decisions(client: Any, sides: list[Side], case: Case, tries: int = 5) -> str:
    """Both checkouts' first call on a fresh prefill of the same instant decide alike
    (retried when a bucket boundary fell between the prefill and a call). The outcome."""
    for _ in range(tries):
        now = int(time.time() * 1000)
        decisions, nows = [], []
        for side in sides:
            data = side.ask(**case.request(side.prefix, now, 1))
            (sha, keys, args) = data["calls"][0]
            if sha != side.sha:
                raise SystemExit(f"{side.name}: the store calls script {sha}, not {side.sha}")
            _fresh(client, side, data["prefill"])
            reply = client.evalsha(side.sha, len(keys), *keys, *args)
            decoded = side.ask(op="decode", reply=_text(reply))
            decisions.append(_decision(decoded))
            nows.append(decoded["now_ms"])
        if {t // case.bucket_ms for t in nows} != {now // case.bucket_ms}:
            continue  # a bucket boundary fell in between: the windows differ, try again
        new, old = decisions
        if new != old:
            raise SystemExit(
                f"the checkouts decide differently on {case}:\n  new {new}\n  old {old}"
            )
        if len(new["keys"]) != case.budgets:
            raise SystemExit(f"{case}: {len(new['keys'])} targets in the reply")
        want = "allow" if case.phase == "admitted" else "reject"
        if new["outcome"] != want:
            raise SystemExit(f"{case}: both checkouts answer {new['outcome']}, wanted {want}")
        return str(new["outcome"])
    raise SystemExit(f"{case}: every try crossed a bucket boundary")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.admit_script_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--against", help="the other (old) checkout: a clone or a git worktree")
    ap.add_argument(
        "--windows",
        default="1h,24h",
        help=f"comma list of windows, of {', '.join(WINDOWS)} (1m: 1 s buckets, 1h and 24h: "
        "1 min, 31d: 1 h)",
    )
    ap.add_argument("--rounds", type=int, default=6, help="rounds per case")
    ap.add_argument("--calls", type=int, default=400, help="calls per script per round")
    ap.add_argument("--smoke", action="store_true", help="one short round per case")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        _serve()
        return 0
    if not args.against:
        ap.error("--against is required")
    windows = [w for w in args.windows.split(",") if w]
    unknown = [w for w in windows if w not in WINDOWS]
    if unknown or not windows:
        ap.error(f"--windows: unknown {unknown}; choose from {', '.join(WINDOWS)}")
    if args.smoke:
        args.rounds, args.calls = 1, 50

    import redis

    client = redis.Redis.from_url(c.REDIS)
    run = c.run_id("lua")
    sides = [
        Side("new", c.ROOT, f"{run}:new:"),
        Side("old", Path(args.against), f"{run}:old:"),
    ]
    bare = client.script_load(BARE)
    rows: list[list[Any]] = []
    try:
        with ExitStack() as stack, tempfile.TemporaryDirectory(prefix=f"{run}-") as tmp:
            for side in sides:
                _start(side, stack, Path(tmp), client)
            c.print_header(
                "ADMIT script A/B (Redis time per call; each checkout its own calls and keys)",
                {
                    "new": f"{c.ROOT} ({sides[0].git()})",
                    "old": f"{args.against} ({sides[1].git()})",
                    "rounds": args.rounds,
                    "calls": args.calls,
                    "windows": windows,
                    "prefill": "every bucket of the window non-empty, 100 each",
                },
            )
            for side in sides:
                print(f"{side.name}: imports {side.files[1]}; ADMIT {side.sha}")
            for window in windows:
                for budgets in (1, 5):
                    for phase in ("admitted", "refused"):
                        case = Case(window, budgets, phase)
                        outcome = _check_decisions(client, sides, case)
                        per: dict[str, list[float]] = {"new": [], "old": [], "bare": []}
                        for r in range(args.rounds):
                            now = int(time.time() * 1000)
                            data = {
                                s.name: s.ask(**case.request(s.prefix, now, args.calls))
                                for s in sides
                            }
                            for side in sides if r % 2 == 0 else sides[::-1]:
                                _fresh(client, side, data[side.name]["prefill"])
                                calls = data[side.name]["calls"]
                                per[side.name].append(_block(client, side.sha, calls))
                            per["bare"].append(_block(client, bare, [["", [], []]] * args.calls))
                        ratios = [n / o for n, o in zip(per["new"], per["old"], strict=True)]
                        new, old = statistics.median(per["new"]), statistics.median(per["old"])
                        ratio, floor = statistics.median(ratios), statistics.median(per["bare"])
                        rows.append(
                            [
                                case.label,
                                budgets,
                                phase,
                                f"{new:,.1f}",
                                f"{old:,.1f}",
                                f"**{ratio:.3f}**",
                                f"{min(ratios):.3f}-{max(ratios):.3f}",
                                f"{floor:.1f}",
                            ]
                        )
                        print(
                            f"  {case.label:>11} {budgets} budget(s) {phase:8} new {new:8.1f} us"
                            f"  old {old:8.1f} us  new/old {ratio:.3f}  bare {floor:5.1f} us"
                            f"  (both decide {outcome})",
                            flush=True,
                        )
    finally:
        for side in sides:
            c.delete_redis_prefix(c.REDIS, side.prefix)
        client.close()
    print()
    c.print_table(
        [
            "window",
            "budgets",
            "requests",
            "new us/call",
            "old us/call",
            "new/old (median)",
            "per-round",
            "bare EVALSHA us",
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
