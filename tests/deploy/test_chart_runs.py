"""The chart's containers run here as Kubernetes would run them (tests/deploy/local_pod.py:
the rendered command, args and env; the non-root uid with its fsGroup; the Secrets in the
kubelet's ``..data`` layout at the chart's mode; a read-only root), on the dev Kafka and
Redis: each reaches ready, the bootstrap Job exits 0, and admission decides under its
policy (200 within the limit, 429 over it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from spendgate.devkafka import KafkaClusterSettings, LocalKafkaCluster
from spendgate.schemas import redis_connect
from spendgate.schemas.redis_connect import RedisSettings
from spendgate.schemas.redis_keys import policies_key
from tests.deploy.local_pod import LocalPod, stop, wait_ready
from tests.fixtures.admission import free_port
from tests.fixtures.helm import CHART, Tools, objects
from tests.fixtures.pipeline import all_marked
from tests.fixtures.services import Services, _unavailable
from tests.fixtures.tls_redis import PASSWORD, Pki, Servers, make_pki, redis_settings, server_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ALL = {"Authorization": "Bearer tok-all"}
LIMIT = 3


def chart_values(tmp_path: Path) -> Path:
    """The default values, plus what a chart-made Secret holds (the subject secret, a
    tokens file, the dashboard's session secret) and one policy for the bootstrap Job."""
    values = {
        "secret": {
            "data": {
                "subject-secret": "a-chart-subject-secret-of-32-bytes",
                "tokens.yaml": "tok-all: '*'\ntok-ops: operator\n",
                "session-secret": "a-chart-session-secret-of-32-bytes",
            }
        },
        "subjectSecretKey": "subject-secret",
        "auth": {"tokensKey": "tokens.yaml", "allowUnauthenticated": False},
        "dashboard": {"sessionSecretKey": "session-secret"},
        "policies": [
            {
                "id": "chart-tight",
                "unit": "requests",
                "limit": LIMIT,
                "window": "5m",
                "bucket": "10s",
                "group_by": ["tenant"],
            }
        ],
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


class Pods:
    """The rendered pods of one release, started here; all stopped after the test."""

    def __init__(self, found: list[dict[str, Any]], work: Path, hosts: list[str]) -> None:
        self.found = found
        self.work = work
        self.hosts = hosts
        self.procs: list[subprocess.Popen[bytes]] = []
        #: Secrets the release names but does not make (``secret.existing``).
        self.external_secrets: dict[str, dict[str, str]] = {}

    def pod(self, kind: str, component: str, **extra: Any) -> LocalPod:
        (workload,) = [
            o
            for o in self.found
            if o["kind"] == kind
            and o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            == component
        ]
        pod = LocalPod(
            workload["spec"]["template"],
            self.found,
            self.work / component,
            self.hosts,
            external_secrets=self.external_secrets,
            **extra,
        )
        pod.prepare()
        return pod

    def start(self, pod: LocalPod, name: str) -> tuple[subprocess.Popen[bytes], float]:
        log = self.work / f"{name}.log"
        proc = pod.start(log)
        self.procs.append(proc)
        return proc, wait_ready(pod, proc, log)

    def stop_all(self) -> None:
        for proc in self.procs:
            stop(proc)


@pytest.fixture
def pods(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pods]:
    """Room for a release's pods: root is needed to lay out volumes as the kubelet does,
    mount them in a namespace of each pod's own and drop to the chart's user."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        _unavailable("running pods as Kubernetes would needs root, unshare and setpriv")
    made = Pods([], tmp_path / "pods", ["kafka", "redis"])
    request.node.spendgate_logs = lambda: sorted((tmp_path / "pods").glob("*.log"))
    try:
        yield made
    finally:
        made.stop_all()


def admit(url: str, tenant: str, requests: int = 1) -> httpx.Response:
    body = {
        "request_id": uuid.uuid4().hex,
        "subject": {"tenant": tenant, "api_key": f"{tenant}-key", "team": "t1"},
        # A known cost: the production values' team-daily policy counts cost_usd.
        "estimate": {"requests": requests, "cost_usd_micros": 1_000},
    }
    return httpx.post(f"{url}/v1/admit", json=body, headers=ALL, timeout=10)


def run_release(
    pods: Pods,
    rendered: str,
    ports: dict[str, int],
    store: redis.Redis,
    prefix: str,
    policy: str,
    within: list[int],
) -> dict[str, float]:
    """Start the release's worker, run its Job, start admission and the dashboard, each
    as Kubernetes would; admits of ``within`` requests are 200 under ``policy``, one more
    429; the seconds each took to be ready."""
    pods.found = objects(rendered)
    full = "t-spendgate"
    pods.hosts += [f"{full}-admission", f"{full}-worker", f"{full}-worker-0.{full}-worker"]
    timings: dict[str, float] = {}

    # The worker: its claim is the only place it writes; the root is read-only.
    claim = pods.work / "claim-data"
    worker = pods.pod("StatefulSet", "worker", claims={"data": claim})
    looked = worker.run(["-c", LOOK_AROUND], program=sys.executable)
    assert looked.returncode == 0, looked.stderr
    assert looked.stdout.splitlines() == [
        "refused /x Read-only file system",
        "refused /opt/x Read-only file system",
        "refused /etc/spendgate/secret/x Read-only file system",
        "wrote /data/probe",
        "uid 10001 10001 [10001]",
    ]
    worker_proc, timings["worker"] = pods.start(worker, "worker")

    # The bootstrap Job, once the release's objects exist (a post-install hook).
    started = time.monotonic()
    done = pods.pod("Job", "policy").run()
    assert done.returncode == 0, done.stdout + done.stderr
    timings["policy job"] = time.monotonic() - started

    _, timings["admission"] = pods.start(pods.pod("Deployment", "admission"), "admission")
    _, timings["dashboard"] = pods.start(pods.pod("Deployment", "dashboard"), "dashboard")

    # The policy is in force once the worker materialized it and vouches for its marks.
    deadline = time.monotonic() + 90
    while not (store.hexists(policies_key(prefix), policy) and all_marked(store, prefix)):
        assert time.monotonic() < deadline, "the policy never reached Redis"
        time.sleep(0.5)
    time.sleep(1.5)  # admission re-reads the policies every second
    url = f"http://127.0.0.1:{ports['admission']}"
    answers = [admit(url, "acme", n) for n in within] + [admit(url, "acme")]
    assert [a.status_code for a in answers] == [200] * len(within) + [429], answers[-1].text
    assert policy in answers[-1].text

    # The dashboard reads the tokens file and signs sessions with the mounted secret.
    dash = f"http://127.0.0.1:{ports['dashboard']}"
    signed_in = httpx.post(f"{dash}/api/session", json={"token": "tok-ops"}, timeout=10)
    assert signed_in.status_code == 200, signed_in.text

    # Stopped as the kubelet does (SIGTERM) within the grace; the worker wrote only to its
    # claim: its emptyDir at /tmp is empty, its tables are on the claim.
    grace = worker.spec["terminationGracePeriodSeconds"]
    start = time.monotonic()
    assert stop(worker_proc, timeout_s=grace) in (0, 4)
    assert time.monotonic() - start < grace
    assert list((worker.work / "volume-tmp").iterdir()) == []
    assert (claim / "tables").is_dir() and any((claim / "tables").iterdir())
    return timings


#: Run in the worker's pod in place of the worker: where it may write, and who it is.
LOOK_AROUND = """
import os
for p in ('/x', '/opt/x', '/etc/spendgate/secret/x', '/data/probe'):
    try:
        open(p, 'w').close(); print('wrote', p); os.remove(p)
    except OSError as e:
        print('refused', p, e.strerror)
print('uid', os.getuid(), os.getgid(), os.getgroups())
"""


def local_sets(ports: dict[str, int], topic_prefix: str, key_prefix: str) -> list[str]:
    """Values that place a release on this machine: its ports and this test's prefixes."""
    return [
        f"topicPrefix={topic_prefix}",
        f"redisPrefix={key_prefix}",
        f"admission.port={ports['admission']}",
        f"dashboard.port={ports['dashboard']}",
        f"worker.metricsPort={ports['worker']}",
        "worker.partitions=2",
        # This test's consumer group (the suite's workers share the broker).
        f"worker.extraEnv[0].name=SPENDGATE_APP_ID,worker.extraEnv[0].value={topic_prefix}app",
    ]


class TestTheChartRunsAsKubernetesWould:
    def test_default_values_with_a_chart_made_secret_on_the_dev_stack(
        self,
        tools: Tools,
        services: Services,
        redis_sync: redis.Redis,
        key_prefix: str,
        topic_prefix: str,
        pods: Pods,
        tmp_path: Path,
    ) -> None:
        ports = {"admission": free_port(), "dashboard": free_port(), "worker": free_port()}
        rendered = tools.template(
            [chart_values(tmp_path)],
            f"kafka.bootstrap={services.kafka_bootstrap}",
            f"redis.url={services.redis_url}",
            *local_sets(ports, topic_prefix, key_prefix),
        )
        assert tools.check(rendered).returncode == 0
        timings = run_release(
            pods, rendered, ports, redis_sync, key_prefix, "chart-tight", [1] * LIMIT
        )
        print(f"ready after (s): { {k: round(v, 1) for k, v in timings.items()} }")

    def test_production_values_on_sasl_ssl_kafka_and_tls_redis(
        self,
        tools: Tools,
        secure_backends: SecureBackends,
        pods: Pods,
        tmp_path: Path,
    ) -> None:
        tag = uuid.uuid4().hex[:8]
        kafka, pki = secure_backends.kafka, secure_backends.pki
        ports = {"admission": free_port(), "dashboard": free_port(), "worker": free_port()}
        rendered = tools.template(
            [CHART / "ci" / "production-values.yaml"],
            "kafka.bootstrap=" + kafka.bootstrap.replace(",", "\\,"),  # --set's escape
            f"redis.url=rediss://127.0.0.1:{secure_backends.redis_port}/0",
            # The suite's TLS Redis is one server, not a cluster; it asks for a client
            # certificate.
            "redis.cluster=false",
            "redis.certKey=redis-client.pem",
            "redis.keyKey=redis-client-key.pem",
            *local_sets(ports, f"p{tag}.", f"p{tag}:"),
        )
        assert tools.check(rendered).returncode == 0
        pods.external_secrets["spendgate-secrets"] = {
            "subject-secret": "a-production-subject-secret-32-bytes",
            "tokens.yaml": "tok-all: '*'\ntok-ops: operator\n",
            "session-secret": "a-production-session-secret-32-bytes",
            "kafka-password": kafka.password_file.read_text().strip(),
            "kafka-ca.pem": kafka.ca_file.read_text(),
            "redis-password": PASSWORD,
            "redis-ca.pem": pki.ca.read_text(),
            "redis-client.pem": pki.client_cert.read_text(),
            "redis-client-key.pem": pki.client_key.read_text(),
        }
        conn = RedisSettings(**redis_settings(pki, secure_backends.redis_port)).redis()
        store = redis_connect.client(conn)
        try:
            # key-minute: 600 requests a minute per tenant and key; one admit takes them.
            timings = run_release(pods, rendered, ports, store, f"p{tag}:", "key-minute", [600])
        finally:
            store.close()
        print(f"ready after (s): { {k: round(v, 1) for k, v in timings.items()} }")


@dataclass
class SecureBackends:
    kafka: LocalKafkaCluster
    pki: Pki
    redis_port: int


#: Three brokers: clients on 28400-28402, controllers on 28500-28502, replication on
#: 28600-28602 (below the other clusters' ranges and the ephemeral ports).
OWN_PORTS = 28400


@pytest.fixture(scope="module")
def secure_backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBackends]:
    """Three SASL_SSL brokers (SCRAM-SHA-512, replication 3 / min in-sync 2) and a TLS
    redis-server with an ACL user and client certificates, for this module."""
    if shutil.which("java") is None or shutil.which("openssl") is None:
        _unavailable("java and openssl are needed for the SASL_SSL brokers")
    folder = tmp_path_factory.mktemp("secure")
    pki = make_pki(folder)
    servers = Servers(folder)
    kafka = LocalKafkaCluster(
        KafkaClusterSettings(kafka_cluster_port=OWN_PORTS, stack_dir=folder / "kafka"),
        3,
        "sasl_ssl",
    )
    try:
        redis_port = free_port()
        servers.start(server_args(pki, redis_port), redis_port, "redis")
        started = time.monotonic()
        kafka.up()
        print(f"\n3 SASL_SSL brokers up in {time.monotonic() - started:.1f} s")
        yield SecureBackends(kafka, pki, redis_port)
    finally:
        kafka.down()
        servers.stop()
