"""The whole path over SASL_SSL to Kafka and TLS + ACL to Redis (issue 44).

One Kafka broker of the test's own (``LocalKafkaCluster``, SASL_SSL with SCRAM-SHA-512)
and one redis-server of its own (TLS, client certificates required, ``default`` user off)
carry a stack of real processes, each given only the variables a user sets from the
README (``SPENDGATE_KAFKA_*`` as ``dev env`` prints them, the password in a file;
``SPENDGATE_REDIS_*`` with ``rediss://``, an ACL user, its password in a file, the CA and
the client certificate): ``policy apply``, the worker, admission, the dashboard and the
LiteLLM callback's policy reader; then admits, refusals, commits and releases over HTTP,
the windows read over TLS against the test's exact ledger, alerts and refusals read over
SASL_SSL, ``alerts tail``, ``simulate`` and ``replay --verify``. A wrong SASL password
and a wrong Redis password stop the worker and admission naming the setting.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from spendgate.devkafka import KafkaClusterSettings, LocalKafkaCluster
from spendgate.schemas import redis_connect
from spendgate.schemas.fastdecode import decode
from spendgate.schemas.redis_connect import RedisSettings
from tests.fixtures.admission import free_port
from tests.fixtures.kafka_io import read_all
from tests.fixtures.services import _unavailable
from tests.fixtures.tls_redis import (
    USER,
    Pki,
    Servers,
    make_pki,
    redis_settings,
    server_args,
)
from tests.fixtures.windows import all_windows, window_differences

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

#: One broker: clients on 30600, its controller on 30700, replication on 30800; below
#: the ephemeral range and apart from the other clusters' ports (29400-29902 in
#: tests/test_devkafka_cluster.py, 30400-30502 in tests/integration/test_kafka_faults.py).
OWN_PORTS = 30600
TENANTS = ("acme", "globex", "initech")
#: Per tenant: three admitted (the limit), then two refused.
ADMITS = 5
LIMIT = 3
ESTIMATE = {"requests": 1, "input_tokens": 100, "output_tokens": 200}
#: What the first two reservations of each tenant actually used (within the estimate,
#: so the windows hold it in the reservation's bucket); the third is released.
ACTUALS = ({"requests": 1, "input_tokens": 100, "output_tokens": 150},
           {"requests": 1, "input_tokens": 80, "output_tokens": 20})  # fmt: skip
POLICIES = """\
- id: tenant-requests
  group_by: [tenant]
  unit: requests
  limit: 3
  window: 1h
  bucket: 1m
  alerts: [0.5, 1.0]
  # Admission unreachable: the LiteLLM callback allows a third of the limit itself.
  failure: degraded
  degraded_allowance: 0.34
- id: tenant-tokens
  group_by: [tenant]
  unit: total_tokens
  limit: 100000
  window: 1h
  bucket: 1m
  failure: open
"""
#: The draft ``simulate`` judges: one request per tenant.
DRAFT = POLICIES.replace("limit: 3", "limit: 1")
#: The LiteLLM callback in a process of its own: its policy reader tails the policies
#: topic over SASL_SSL (from SPENDGATE_KAFKA_*); admission is unreachable, so the policies
#: it read decide two calls of one team.
LITELLM_READER = textwrap.dedent(
    """
    import asyncio, json, sys
    from types import SimpleNamespace
    from spendgate.integrations.litellm import SpendgateLogger, SpendgateRefusal

    async def main() -> None:
        handler = SpendgateLogger()
        await handler.start()
        calls = []
        for _ in range(2):
            key = SimpleNamespace(api_key="hash-1", team_id=sys.argv[1])
            data = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            try:
                await handler.async_pre_call_hook(key, None, data, "acompletion")
                calls.append(200)
            except SpendgateRefusal as exc:
                calls.append(exc.status_code)
        print(json.dumps({"policies": sorted(handler._book.policies), "calls": calls}))
        await handler.aclose()

    asyncio.run(main())
    """
)


@dataclass
class SecureStack:
    """The broker and the redis-server, and the environment a user would set for them."""

    kafka: LocalKafkaCluster
    pki: Pki
    redis_port: int
    folder: Path
    #: Every process started, stopped at the end if still running.
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def kafka_env(self) -> dict[str, str]:
        """The ``export`` lines ``spendgate dev env`` prints, as a shell would set them."""
        env = {}
        for line in self.kafka.env_lines():
            name, _, value = shlex.split(line.removeprefix("export "))[0].partition("=")
            env[name] = value
        return env

    @staticmethod
    def basics() -> dict[str, str]:
        """The shell's own variables a process needs; never this process's SPENDGATE_*."""
        keep = ("PATH", "HOME", "LANG", "TMPDIR")
        return {k: v for k, v in os.environ.items() if k in keep} | {"PYTHONUNBUFFERED": "1"}

    def env(self, **more: str) -> dict[str, str]:
        """A process's whole environment: the shell's basics, the README's variables for
        this Kafka and this Redis, and ``more``."""
        pki = self.pki
        return {
            **self.basics(),
            **self.kafka_env(),
            "SPENDGATE_REDIS_URL": f"rediss://127.0.0.1:{self.redis_port}/0",
            "SPENDGATE_REDIS_USERNAME": USER,
            "SPENDGATE_REDIS_PASSWORD_FILE": str(pki.password_file),
            "SPENDGATE_REDIS_SSL_CAFILE": str(pki.ca),
            "SPENDGATE_REDIS_SSL_CERTFILE": str(pki.client_cert),
            "SPENDGATE_REDIS_SSL_KEYFILE": str(pki.client_key),
            **more,
        }

    def start(self, args: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        """``spendgate ARGS`` in the background, its output in ``<name>.log``."""
        with open(self.folder / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "spendgate", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def run(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        """``spendgate ARGS`` with its output captured."""
        return self.track([sys.executable, "-m", "spendgate", *args], env)

    def track(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        """``cmd`` with its output captured, stopped at the end if still running."""
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        """The tail of a background process's log (for a failure's message)."""
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop_all(self) -> None:
        """SIGTERM what still runs, then SIGKILL what does not stop within 30 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.communicate(timeout=30)  # closes the pipes of captured ones
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        self.procs.clear()


@pytest.fixture(scope="module", autouse=True)
def wall_time() -> Iterator[None]:
    """The file's wall time, printed at its end (the issue bounds the suite's growth)."""
    started = time.monotonic()
    yield
    print(f"\ntest_secure_stack: {time.monotonic() - started:.1f} s wall for the file")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    """One SASL_SSL broker and one TLS + ACL redis-server for the module's tests."""
    if shutil.which("java") is None or shutil.which("openssl") is None:
        _unavailable("java and openssl are needed for the SASL_SSL broker")
    folder = tmp_path_factory.mktemp("secure")
    pki = make_pki(folder)
    servers = Servers(folder)
    settings = KafkaClusterSettings(kafka_cluster_port=OWN_PORTS, stack_dir=folder / "kafka")
    kafka = LocalKafkaCluster(settings, 1, "sasl_ssl")
    stack: SecureStack | None = None
    try:
        redis_port = free_port()
        servers.start(server_args(pki, redis_port), redis_port, "redis")
        started = time.monotonic()
        kafka.up()
        print(f"\nSASL_SSL broker up in {time.monotonic() - started:.1f} s")
        stack = SecureStack(kafka, pki, redis_port, folder)
        yield stack
    finally:
        if stack is not None:
            stack.stop_all()
        kafka.down()
        servers.stop()


def _wait(
    what: str, probe: Callable[[], object], timeout_s: float, *watched: subprocess.Popen[bytes]
) -> None:
    """Poll ``probe`` until truthy; fail naming ``what`` (or a process that exited
    meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        for proc in watched:
            assert proc.poll() is None, f"{proc.args!r} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _deciding(base: str) -> bool:
    """Whether admission holds both policies and every partition mark is vouched (the
    worker has materialized the policies and vouches for its windows)."""
    try:
        status = httpx.get(f"{base}/v1/status", timeout=2)
        subject = {"tenant": TENANTS[0], "api_key": "k1", "model": "m"}
        budgets = httpx.get(f"{base}/v1/budgets", params=subject, timeout=2)
    except httpx.HTTPError:
        return False
    return (
        status.status_code == budgets.status_code == 200
        and status.json()["decidable"] is True
        and len(budgets.json()["budgets"]) == 2
    )


def _done(proc: subprocess.Popen[str], timeout_s: float = 90) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


class TestSecureStack:
    def test_the_whole_path_over_sasl_ssl_and_tls(self, secure: SecureStack) -> None:
        tag = uuid.uuid4().hex[:8]
        adm_port, dash_port, metrics_port = free_port(), free_port(), free_port()
        env = secure.env(
            SPENDGATE_TOPIC_PREFIX=f"s{tag}.",
            SPENDGATE_REDIS_PREFIX=f"s{tag}:",
            SPENDGATE_APP_ID=f"s{tag}.app",
            SPENDGATE_PARTITIONS="2",
            SPENDGATE_DATA_DIR=str(secure.folder / f"tables-{tag}"),
            SPENDGATE_METRICS_PORT=str(metrics_port),
            SPENDGATE_ADMISSION_PORT=str(adm_port),
            SPENDGATE_POLICY_REFRESH_S="0.1",
            SPENDGATE_REDIS_TIMEOUT_S="5.0",
            SPENDGATE_DASHBOARD_PORT=str(dash_port),
            SPENDGATE_ADMISSION_METRICS_URL=f"http://127.0.0.1:{adm_port}/metrics",
            SPENDGATE_WORKER_METRICS_URL=f"http://127.0.0.1:{metrics_port}/metrics",
            SPENDGATE_SCRAPE_S="0.5",
        )
        policies, draft = secure.folder / "policies.yaml", secure.folder / "draft.yaml"
        policies.write_text(POLICIES)
        draft.write_text(DRAFT)
        kafka = secure.kafka.connection()
        redis_conn = RedisSettings(**redis_settings(secure.pki, secure.redis_port)).redis()

        # 1. policy apply (it creates the topics), then every long-running process at once.
        code, out, err = _done(secure.run(["policy", "apply", str(policies)], env))
        assert code == 0, out + err
        worker = secure.start(["worker"], env, "worker")
        admission = secure.start(["admission"], env, "admission")
        dashboard = secure.start(["dashboard"], env, "dashboard")
        reader = secure.track(
            [sys.executable, "-c", LITELLM_READER, "acme"],
            {
                **secure.basics(),
                **secure.kafka_env(),
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "SPENDGATE_LITELLM_KAFKA_BOOTSTRAP": secure.kafka.bootstrap,
                "SPENDGATE_LITELLM_TOPIC_PREFIX": env["SPENDGATE_TOPIC_PREFIX"],
                "SPENDGATE_LITELLM_ADMISSION_URL": f"http://127.0.0.1:{free_port()}",
                "SPENDGATE_LITELLM_RETRIES": "0",
            },
        )
        base = f"http://127.0.0.1:{adm_port}"
        try:
            _wait("admission deciding", lambda: _deciding(base), 60, worker, admission)
        except AssertionError:
            raise AssertionError(secure.log("worker") + secure.log("admission")) from None

        # 2. The workload, over HTTP: per tenant 3 admitted, 2 refused; 2 commits, 1 release.
        codes: Counter[int] = Counter()
        admitted: dict[str, tuple[str, int, int]] = {}  # reservation -> tenant, from, to ms
        refused: set[str] = set()
        settled: dict[str, dict[str, int] | None] = {}  # reservation -> actual (None: released)
        with httpx.Client(base_url=base, timeout=10) as http:
            for tenant in TENANTS:
                mine = []
                for i in range(ADMITS):
                    request_id = f"{tenant}-{tag}-{i}"
                    body = {
                        "request_id": request_id,
                        "subject": {"tenant": tenant, "api_key": "k1", "model": "m"},
                        "estimate": ESTIMATE,
                    }
                    before = time.time_ns() // 1_000_000
                    answer = http.post("/v1/admit", json=body)
                    after = -(-time.time_ns() // 1_000_000)
                    codes[answer.status_code] += 1
                    if answer.status_code == 200:
                        rid = answer.json()["reservation_id"]
                        admitted[rid] = (tenant, before, after)
                        mine.append(rid)
                    else:
                        assert answer.status_code == 429, answer.text
                        assert answer.json()["violated"] == ["tenant-requests"]
                        refused.add(request_id)
                for rid, actual in zip(mine, ACTUALS, strict=False):
                    answer = http.post("/v1/commit", json={"reservation_id": rid, "usage": actual})
                    assert answer.status_code == 202, answer.text
                    codes[answer.status_code] += 1
                    settled[rid] = actual
                released = mine[len(ACTUALS)]
                answer = http.post("/v1/release", json={"reservation_id": released})
                assert answer.status_code == 202, answer.text
                codes[answer.status_code] += 1
                settled[released] = None
        print(f"answers by code: {dict(sorted(codes.items()))}")
        n = len(TENANTS)
        assert codes == {200: LIMIT * n, 429: (ADMITS - LIMIT) * n, 202: LIMIT * n}

        # 3. The exact ledger: each reservation's amount (its actual; 0 released) in the
        # bucket of its reserve, whose instant (read back over SASL_SSL) lies within the
        # admit call that made it.
        prefix = env["SPENDGATE_TOPIC_PREFIX"]
        usage = [decode(v) for v in asyncio.run(read_all(kafka, f"{prefix}usage"))]
        reserved_at = {e.reservation_id: e.occurred_ms for e in usage if e.kind == "reserve"}
        assert set(reserved_at) == set(admitted)
        assert Counter(e.kind for e in usage) == {"reserve": 9, "commit": 6, "release": 3}
        expected: dict[str, dict[int, int]] = {}
        for rid, (tenant, before, after) in admitted.items():
            at = reserved_at[rid]
            assert before <= at <= after, (rid, before, at, after)
            bucket = at - at % 60_000
            actual = settled[rid] or {}
            for policy, amount in (
                ("tenant-requests", actual.get("requests", 0)),
                ("tenant-tokens", actual.get("input_tokens", 0) + actual.get("output_tokens", 0)),
            ):
                cells = expected.setdefault(f"{policy}|tenant={tenant}", {})
                cells[bucket] = cells.get(bucket, 0) + amount
        tls = redis_connect.client(redis_conn)
        try:
            redis_prefix = env["SPENDGATE_REDIS_PREFIX"]
            _wait(
                "the windows in Redis equal the ledger",
                lambda: window_differences(tls, redis_prefix, expected) is None,
                30,
                worker,
            )
            held = all_windows(tls, redis_prefix)
        finally:
            tls.close()
        units = sum(sum(b.values()) for b in expected.values())
        print(f"windows over TLS equal the ledger: {len(held)} keys, {units} units")

        # 4. Refusals and alerts, read over SASL_SSL.
        def refusals_in() -> set[str]:
            values = asyncio.run(read_all(kafka, f"{prefix}refusals"))
            return {str(json.loads(v).get("request_id")) for v in values}

        _wait("the refusals on the refusals topic", lambda: refused <= refusals_in(), 20)
        alerts = [json.loads(v) for v in asyncio.run(read_all(kafka, f"{prefix}alerts"))]
        kinds = {(a["key"], a["kind"]) for a in alerts}
        for tenant in TENANTS:
            key = f"tenant-requests|tenant={tenant}"
            assert {(key, "threshold"), (key, "exhausted")} <= kinds, alerts
        print(f"refusals on the topic: {len(refused)}; alerts: {len(alerts)}")

        # 5. alerts tail and simulate (read-only) at once, while the worker stops for replay.
        tail = secure.run(["alerts", "tail", "--from-beginning", "--no-follow"], env)
        simulate = secure.run(["simulate", "--policies", str(draft), "--json"], env)
        worker.terminate()
        code, out, err = _done(tail)
        assert code == 0, out + err
        tailed = {line.split()[-1] for line in out.splitlines() if " id " in line}
        assert tailed == {a["alert_id"] for a in alerts}, out
        code, out, err = _done(simulate)
        assert code == 0, out + err
        report = json.loads(out)
        judged = {p["policy"]: p for p in report["policies"]}["tenant-requests"]
        # Under one request per tenant, each tenant's first is admitted, the rest refused.
        assert (judged["requests"], judged["refused"]) == (ADMITS * n, (ADMITS - 1) * n), report
        assert report["refusal_records"] == len(refused)
        print(f"simulate: {judged['refused']} of {judged['requests']} refused under the draft")
        assert worker.wait(timeout=30) is not None
        code, out, err = _done(secure.run(["replay", "--verify"], env))
        assert code == 0, out + err
        assert "verified: Redis equals the rebuilt windows" in out + err
        print("replay --verify: Redis equals the rebuilt windows")

        # 6. The dashboard's alerts feed, and the LiteLLM callback's policy reader.
        def dashboard_alerts() -> set[str]:
            if not _answers(f"http://127.0.0.1:{dash_port}/healthz"):
                return set()
            live = httpx.get(f"http://127.0.0.1:{dash_port}/api/live", timeout=5).json()
            return {a["alert_id"] for a in live["alerts"]}

        try:
            _wait("the dashboard's alerts", lambda: dashboard_alerts() == tailed, 30, dashboard)
        except AssertionError:
            raise AssertionError(secure.log("dashboard")) from None
        out, err = reader.communicate(timeout=60)
        assert reader.returncode == 0, out + err
        seen_by_litellm = json.loads(out.splitlines()[-1])
        assert seen_by_litellm["policies"] == ["tenant-requests", "tenant-tokens"]
        # Degraded: a third of 3 per window, this proxy's own count.
        assert seen_by_litellm["calls"] == [200, 429]
        print(f"dashboard alerts: {len(tailed)}; LiteLLM reader: {seen_by_litellm}")

    def test_wrong_passwords_stop_the_services_naming_the_setting(
        self, secure: SecureStack
    ) -> None:
        tag = uuid.uuid4().hex[:8]
        wrong = secure.folder / f"wrong-{tag}"
        wrong.write_text("not-the-password\n")
        wrong.chmod(0o600)
        names = {
            "SPENDGATE_TOPIC_PREFIX": f"w{tag}.",
            "SPENDGATE_REDIS_PREFIX": f"w{tag}:",
            "SPENDGATE_APP_ID": f"w{tag}.app",
            "SPENDGATE_DATA_DIR": str(secure.folder / f"tables-{tag}"),
            "SPENDGATE_METRICS_PORT": "0",
            "SPENDGATE_ADMISSION_PORT": str(free_port()),
        }
        worker = secure.run(
            ["worker"],
            secure.env(**names, SPENDGATE_KAFKA_SASL_PASSWORD_FILE=str(wrong)),
        )
        admission = secure.run(
            ["admission"], secure.env(**names, SPENDGATE_REDIS_PASSWORD_FILE=str(wrong))
        )
        code, out, err = _done(worker, 60)
        assert code != 0
        naming = [ln for ln in (out + err).splitlines() if "SPENDGATE_KAFKA_SASL_PASSWORD" in ln]
        assert len(naming) == 1 and naming[0].startswith("error: "), out + err
        assert "not-the-password" not in out + err and "Traceback" not in out + err
        print(f"worker: {naming[0]}")
        code, out, err = _done(admission, 60)
        assert code != 0
        naming = [ln for ln in (out + err).splitlines() if "SPENDGATE_REDIS_PASSWORD" in ln]
        assert len(naming) == 1 and naming[0].startswith("error: "), out + err
        assert "not-the-password" not in out + err and "Traceback" not in out + err
        print(f"admission: {naming[0]}")
