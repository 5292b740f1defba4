"""`spendgate dev cluster`: a real Redis Cluster on loopback forms, serves, fails over.

Runs its own cluster on ports the suite's cluster does not use, in a temporary folder.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster
from redis.exceptions import BusyLoadingError, RedisClusterException

from spendgate.devcluster import ClusterSettings, LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

#: Below the ephemeral range (32768-60999), so no test's free port can land on a node or on
#: its cluster bus (port + 10000), which the other nodes keep dialling while it is down.
OWN_PORTS = 7300


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    nodes = LocalCluster(ClusterSettings(cluster_port=OWN_PORTS, stack_dir=tmp_path))
    for port in nodes.ports:
        for p in (port, port + 10_000):
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", p)) != 0, f"port {p} is in use"
    yield nodes
    nodes.down()


def test_the_cluster_forms_serves_and_fails_over(own_cluster: LocalCluster) -> None:
    nodes = own_cluster
    statuses = nodes.up()
    assert [s.role for s in statuses].count("master") == 3
    assert [s.role for s in statuses].count("replica") == 3
    assert nodes.healthy()
    client = RedisCluster.from_url(nodes.url)
    try:
        # Keys sharing a hash tag run in one script; keys of two slots never do.
        script = client.register_script(
            "return redis.call('INCRBY', KEYS[1], 2) + redis.call('INCR', KEYS[2])"
        )
        assert script(keys=["t:{s1}a", "t:{s1}b"]) == 3
        with pytest.raises(RedisClusterException, match="same key slot"):
            script(keys=["t:{s1}a", "t:{s2}b"])
        # One more write on a connection of its own to the master of {s1}, and WAIT there
        # until a replica has acknowledged it (replication is asynchronous: without the
        # acknowledgement a kill can beat the write to the replica). WAIT covers this
        # connection's writes; the script's, earlier in the master's replication stream,
        # are covered with them.
        master = client.get_node_from_key("t:{s1}a").port
        primary = redis.Redis(port=master, single_connection_client=True, socket_timeout=30)
        try:
            assert primary.incr("t:{s1}a") == 3
            acked = primary.wait(1, 20_000)
        finally:
            primary.close()
        assert acked >= 1, f"no replica acknowledged the write within 20 s ({acked})"
        # kill -9 the master of {s1}: its replica takes over with the acknowledged writes.
        pid = nodes.pid(master)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            try:
                value = client.get("t:{s1}a")
                break
            except (redis.RedisError, OSError):
                assert time.monotonic() < deadline, "no failover in 30 s"
                time.sleep(0.3)
        assert value == b"3"
        assert client.get("t:{s1}b") == b"1"
        assert client.get_node_from_key("t:{s1}a").port != master
        assert not nodes.healthy()
        # The killed node rejoins as a replica of its old slots' new master.
        nodes.start_node(master)
        deadline = time.monotonic() + 30
        while not nodes.healthy():
            assert time.monotonic() < deadline, "the node did not rejoin in 30 s"
            time.sleep(0.3)
        assert nodes.role(master) == "replica"
    finally:
        client.close()
    assert sorted(nodes.down()) == nodes.ports
    nodes.wipe()
    assert not nodes.dir.exists()


def test_up_waits_for_nodes_still_loading_their_data(
    own_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node restarted on data of its own answers ``ROLE`` while it loads, and may answer
    ``LOADING`` to ``CLUSTER INFO``: ``up`` waits for it instead of failing (a CI run
    failed so, on the dev cluster's data kept from earlier runs). The loading replies are
    the node's first three answers here: a real node's loading window is too short and
    uneven to hit on purpose."""
    nodes = own_cluster
    nodes.up()
    first = nodes.ports[0]
    real_info = LocalCluster._info
    loading = {"left": 3}

    def info(self: LocalCluster, port: int) -> dict[str, str]:
        if port == first and loading["left"] > 0:
            loading["left"] -= 1
            raise BusyLoadingError("Redis is loading the dataset in memory")
        return real_info(self, port)

    monkeypatch.setattr(LocalCluster, "_info", info)
    statuses = nodes.up()
    assert loading["left"] == 0
    assert [s.role for s in statuses].count("master") == 3
    assert nodes.healthy()
