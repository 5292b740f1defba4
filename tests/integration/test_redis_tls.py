"""Redis over TLS with an ACL user, through the one connection setting: a redis-server of
the test's own (certificates made with openssl, client certificates required, the
``default`` user off), then admission's own client and scripts on it; a wrong password
and an untrusted certificate are one line naming the variable; the same on a Redis
Cluster of three TLS masters."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from spendgate.admission.app import create_app
from spendgate.admission.server import budget_store, redis_client
from spendgate.admission.settings import AdmissionSettings
from spendgate.schemas import redis_connect
from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_connect import RedisConnection, RedisSettings
from spendgate.streams.materialize import RedisMaterializer
from tests.fixtures.admission import (
    TOPOLOGY,
    VOUCHED,
    Admission,
    RecordingPublisher,
    free_port,
)
from tests.fixtures.tls_redis import (
    USER,
    Pki,
    Servers,
    make_pki,
    redis_settings,
    server_args,
)

pytestmark = pytest.mark.integration

POLICY = Policy.model_validate(
    {"id": "per-tenant", "limit": 2, "unit": "requests", "window": "1h", "group_by": ["tenant"]}
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    started = Servers(tmp_path)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def tls_redis(pki: Pki, servers: Servers) -> int:
    """The TLS port of one redis-server: client certificates required, ACL user only."""
    port = free_port()
    servers.start(server_args(pki, port), port, "one")
    return port


async def _refused(conn: RedisConnection) -> str:
    client = redis_connect.async_client(conn, socket_timeout=5, socket_connect_timeout=5)
    try:
        with pytest.raises(ConfigurationError) as info:
            await redis_connect.check(client, conn)
    finally:
        await client.aclose()
    # The socket of a failed TLS handshake is left to the garbage collector (asyncio on
    # Python 3.11 under redis-py): collected here, in the test that caused it, whose
    # mark ignores that ResourceWarning, never in a later test.
    gc.collect()
    return str(info.value)


#: For the tests whose TLS handshake fails on purpose (see :func:`_refused`).
FAILED_HANDSHAKE = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning"
)


class TestOneRedis:
    async def test_admission_admits_over_tls_as_the_acl_user(
        self, pki: Pki, tls_redis: int
    ) -> None:
        prefix = f"tls{uuid.uuid4().hex[:8]}:"
        settings = AdmissionSettings(
            **redis_settings(pki, tls_redis),
            redis_prefix=prefix,
            redis_timeout_s=5.0,
            redis_down_s=0.0,
            policy_refresh_s=0.05,
        )
        conn = settings.redis()
        assert "tls-acl" not in repr(settings) + repr(conn) + conn.redacted()
        client = redis_client(settings)
        try:
            assert await redis_connect.check(client, conn)
            assert await client.acl_whoami() in (USER, USER.encode())
            publisher = RecordingPublisher()
            store = budget_store(settings, client)
            app = create_app(store, publisher)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://adm") as http:
                adm = Admission(http, store, publisher, prefix, client)
                await adm.policies(POLICY)
                # Each admit is the admit script (EVALSHA) run on the TLS connection.
                answers = [(await adm.admit("acme", requests=1)).status_code for _ in range(3)]
            assert answers == [200, 200, 429]
            assert publisher.kinds() == ["reserve", "reserve"]
        finally:
            await client.aclose()
        # The CLI's blocking client, on the same settings.
        sync = redis_connect.client(conn)
        assert sync.ping() is True
        sync.close()

    async def test_a_wrong_password_names_the_password_settings(
        self, pki: Pki, tls_redis: int
    ) -> None:
        conn = RedisSettings(
            **redis_settings(pki, tls_redis, redis_password_file=str(pki.wrong_password_file))
        ).redis()
        message = await _refused(conn)
        assert message.startswith(f"Redis at rediss://{USER}:***@127.0.0.1:{tls_redis}/0 ")
        assert "SPENDGATE_REDIS_PASSWORD or SPENDGATE_REDIS_PASSWORD_FILE" in message
        assert "not-it" not in message and "\n" not in message

    @FAILED_HANDSHAKE
    async def test_an_untrusted_certificate_names_the_ca_setting(
        self, pki: Pki, tls_redis: int
    ) -> None:
        conn = RedisSettings(
            **redis_settings(pki, tls_redis, redis_ssl_cafile=str(pki.other_ca))
        ).redis()
        message = await _refused(conn)
        assert f"not trusted by SPENDGATE_REDIS_SSL_CAFILE ({pki.other_ca})" in message
        assert message.endswith("self-signed certificate in certificate chain")

    @FAILED_HANDSHAKE
    async def test_no_client_certificate_when_the_server_asks_names_the_tls_settings(
        self, pki: Pki, tls_redis: int
    ) -> None:
        conn = RedisSettings(
            **redis_settings(pki, tls_redis, redis_ssl_certfile=None, redis_ssl_keyfile=None)
        ).redis()
        message = await _refused(conn)
        assert "SPENDGATE_REDIS_SSL_CERTFILE and SPENDGATE_REDIS_SSL_KEYFILE" in message


#: Three masters, no replicas: the slots split in thirds.
SLOTS = ((0, 5460), (5461, 10922), (10923, 16383))


@pytest.fixture(scope="module")
def tls_cluster(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """The TLS ports of a Redis Cluster of three masters (TLS on the bus too), the same
    ACL user on each, slots assigned and met through the blocking factory's clients."""
    servers = Servers(tmp_path_factory.mktemp("cluster"))
    try:
        yield _cluster(pki, servers)
    finally:
        servers.stop()


def _cluster(pki: Pki, servers: Servers) -> list[int]:
    ports = [free_port() for _ in SLOTS]
    buses = [free_port() for _ in SLOTS]
    for i, (port, bus) in enumerate(zip(ports, buses, strict=True)):
        cluster = ["--cluster-enabled", "yes", "--cluster-port", str(bus),
                   "--tls-cluster", "yes", "--cluster-config-file", "nodes.conf"]  # fmt: skip
        args = [*server_args(pki, port), *cluster]
        servers.start(args, port, f"node{i}")
    nodes = [RedisSettings(**redis_settings(pki, port)).redis() for port in ports]
    clients = [redis_connect.client(node) for node in nodes]
    try:
        for client, (first, last) in zip(clients, SLOTS, strict=True):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for port, bus in zip(ports[1:], buses[1:], strict=True):
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
        deadline = time.monotonic() + 15
        while not all(b"cluster_state:ok" in _info(c) for c in clients):
            assert time.monotonic() < deadline, [_info(c) for c in clients]
            time.sleep(0.05)
    finally:
        for client in clients:
            client.close()
    return ports


def _info(client: Any) -> bytes:
    found = client.execute_command("CLUSTER", "INFO")
    return found if isinstance(found, bytes) else str(found).encode()


class TestCluster:
    async def test_admission_admits_on_a_tls_cluster_as_the_acl_user(
        self, pki: Pki, tls_cluster: list[int]
    ) -> None:
        prefix = f"tls{uuid.uuid4().hex[:8]}:"
        settings = AdmissionSettings(
            **redis_settings(pki, tls_cluster[1]),
            redis_cluster=True,
            redis_wait_replicas=0,  # masters only
            redis_prefix=prefix,
            redis_timeout_s=5.0,
            redis_down_s=0.0,
            policy_refresh_s=0.05,
        )
        conn = settings.redis()
        client = redis_client(settings)
        try:
            assert await redis_connect.check(client, conn)
            assert len(client.get_primaries()) == 3  # type: ignore[attr-defined]
            publisher = RecordingPublisher()
            store = budget_store(settings, client)
            materializer = RedisMaterializer(
                client,
                prefix,
                limit_of=lambda _: POLICY.limit,
                layout=store.layout,
                policy_of=lambda _: POLICY,
            )
            await materializer.stand_in([POLICY], TOPOLOGY, VOUCHED)
            app = create_app(store, publisher)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://adm") as http:
                adm = Admission(http, store, publisher, prefix, client)
                tenants = [f"team-{i}" for i in range(6)]  # homes on more than one node
                answers = await asyncio.gather(
                    *(adm.admit(t, requests=1) for t in tenants for _ in range(3))
                )
            codes = [a.status_code for a in answers]
            assert sorted(codes) == [200] * 12 + [429] * 6, codes
        finally:
            await client.aclose()

    async def test_a_wrong_password_on_a_cluster_names_the_password_settings(
        self, pki: Pki, tls_cluster: list[int]
    ) -> None:
        wrong = redis_settings(
            pki, tls_cluster[0], redis_password_file=str(pki.wrong_password_file)
        )
        message = await _refused(RedisSettings(**wrong, redis_cluster=True).redis())
        assert "SPENDGATE_REDIS_PASSWORD or SPENDGATE_REDIS_PASSWORD_FILE" in message

    @FAILED_HANDSHAKE
    async def test_an_untrusted_certificate_on_a_cluster_names_the_ca_setting(
        self, pki: Pki, tls_cluster: list[int]
    ) -> None:
        other = redis_settings(pki, tls_cluster[2], redis_ssl_cafile=str(pki.other_ca))
        message = await _refused(RedisSettings(**other, redis_cluster=True).redis())
        assert "not trusted by SPENDGATE_REDIS_SSL_CAFILE" in message
