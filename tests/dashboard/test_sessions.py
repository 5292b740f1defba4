"""Dashboard sessions across real processes: a restart and a second replica sharing the
session secret take a cookie; tampered, expired and signed-out cookies are refused."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from spendgate.admission.auth import Authorizer
from spendgate.dashboard.sessions import Sessions
from spendgate.schemas.redis_keys import signed_out_key
from tests.fixtures.admission import free_port
from tests.fixtures.dashboard import Process, wait_for
from tests.fixtures.services import Services

pytestmark = pytest.mark.integration

SECRET = "a-dashboard-session-secret-32-bytes"
TOKENS = {"tok-a": ["a"], "tok-b": ["b"]}


class Replicas:
    """Dashboard processes on one Redis prefix, sharing a tokens file and a session secret
    file (both group-readable, as a Kubernetes Secret volume mounts them)."""

    def __init__(self, services: Services, prefix: str, tmp_path: Path) -> None:
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text("".join(f"{t}: {g}\n" for t, g in TOKENS.items()))
        secret = tmp_path / "session-secret"
        secret.write_text(SECRET + "\n")
        for path in (tokens, secret):
            path.chmod(0o440)
        self.tmp_path = tmp_path
        self.env = {
            **os.environ,
            "SPENDGATE_KAFKA_BOOTSTRAP": services.kafka_bootstrap,
            "SPENDGATE_REDIS_URL": services.redis_url,
            "SPENDGATE_REDIS_PREFIX": prefix,
            "SPENDGATE_TOPIC_PREFIX": prefix.replace(":", "."),
            "SPENDGATE_AUTH_TOKENS_FILE": str(tokens),
            "SPENDGATE_DASHBOARD_SESSION_SECRET_FILE": str(secret),
            # Nothing to scrape: the metrics panel stays empty.
            "SPENDGATE_ADMISSION_METRICS_URL": "http://127.0.0.1:9/metrics",
            "SPENDGATE_WORKER_METRICS_URL": "http://127.0.0.1:9/metrics",
        }
        self.procs: list[Process] = []

    def start(self, name: str, port: int) -> str:
        env = {**self.env, "SPENDGATE_DASHBOARD_PORT": str(port)}
        proc = Process(["dashboard"], env, self.tmp_path / f"{name}.log")
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for(name, lambda: proc.answers(url + "/healthz"), 60)
        return url

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def replicas(
    services: Services, key_prefix: str, redis_sync: redis.Redis, tmp_path: Path
) -> Iterator[Replicas]:
    made = Replicas(services, key_prefix, tmp_path)
    try:
        yield made
    finally:
        made.stop_all()


def me(url: str, cookie: str) -> dict[str, object]:
    answer = httpx.get(f"{url}/api/me", cookies={"spendgate_session": cookie}, timeout=10)
    assert answer.status_code == 200, answer.text
    body: dict[str, object] = answer.json()
    return body


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TestAcrossProcesses:
    def test_a_session_survives_a_restart_and_works_on_a_second_replica(
        self, replicas: Replicas, redis_sync: redis.Redis, key_prefix: str
    ) -> None:
        port_one, port_two = free_port(), free_port()
        one = replicas.start("one", port_one)
        signed_in = httpx.post(f"{one}/api/session", json={"token": "tok-a"}, timeout=10)
        assert signed_in.status_code == 200
        cookie = signed_in.cookies["spendgate_session"]
        kept = httpx.post(f"{one}/api/session", json={"token": "tok-a"}, timeout=10).cookies[
            "spendgate_session"
        ]
        signed_in_a = {"signed_in": True, "auth": True, "operator": False, "tenants": ["a"]}
        assert me(one, cookie) == signed_in_a

        # A second replica sharing the secret takes it; so does the first after a restart.
        two = replicas.start("two", port_two)
        assert me(two, cookie) == signed_in_a
        replicas.procs[0].stop()
        one = replicas.start("one-restarted", port_one)
        assert me(one, cookie) == signed_in_a

        # Tampered: the payload made to name tenant b's token, or to last longer, keeping
        # the signature; and a signature changed.
        version, payload, signature = cookie.split(".")
        claims = json.loads(unb64(payload))
        other = httpx.post(f"{one}/api/session", json={"token": "tok-b"}, timeout=10)
        b_tid = json.loads(unb64(other.cookies["spendgate_session"].split(".")[1]))["tid"]
        for changed in ({**claims, "tid": b_tid}, {**claims, "exp": claims["exp"] + 86_400}):
            tampered = f"{version}.{b64(json.dumps(changed).encode())}.{signature}"
            assert me(two, tampered) == {"signed_in": False, "auth": True}
        flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
        assert me(two, f"{version}.{payload}.{flipped}") == {"signed_in": False, "auth": True}

        # Expired: a cookie signed with the right secret, its expiry past.
        past = Sessions(
            SECRET.encode(),
            60,
            Authorizer({"tok-a": frozenset({"a"})}),
            sign_outs=None,  # type: ignore[arg-type]
            clock=lambda: claims["iat"] - 3_600,
        ).open("tok-a")
        assert me(one, past) == {"signed_in": False, "auth": True}
        answer = httpx.get(f"{one}/api/budgets", cookies={"spendgate_session": past}, timeout=10)
        assert answer.status_code == 401

        # Signed out on one replica: refused on both, the record in Redis expiring with the
        # cookie; the same token's other session stays.
        out = httpx.delete(f"{two}/api/session", cookies={"spendgate_session": cookie}, timeout=10)
        assert out.status_code == 200
        for url in (one, two):
            assert me(url, cookie) == {"signed_in": False, "auth": True}
            assert me(url, kept) == signed_in_a
        sid = claims["sid"]
        ttl_ms = redis_sync.pttl(signed_out_key(key_prefix, sid))
        assert 0 < ttl_ms <= (claims["exp"] - claims["iat"]) * 1000
