"""Partitions and applied marks a budget key depends on (``schemas.shards``)."""

from __future__ import annotations

from aiokafka.partitioner import murmur2 as kafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.shards import (
    Topology,
    keyed_mark,
    murmur2,
    partition_for,
    tenant_scoped,
    usage_mark,
)
from tests.fixtures.factories import PolicyFactory


class TestMurmur2:
    @given(st.binary(max_size=64))
    def test_equals_the_kafka_client_hash(self, data: bytes) -> None:
        assert murmur2(data) == kafka_murmur2(data)

    def test_known_java_values(self) -> None:
        # From the Java client's UtilsTest (org.apache.kafka.common.utils).
        assert murmur2(b"21") == 0xFFFFFFFF & -973932308
        assert murmur2(b"abc") == 0xFFFFFFFF & 479470107

    @given(st.binary(max_size=32), st.integers(1, 64))
    def test_partition_is_in_range_and_as_the_default_partitioner(
        self, key: bytes, partitions: int
    ) -> None:
        assert partition_for(key, partitions) == (kafka_murmur2(key) & 0x7FFFFFFF) % partitions


class TestTenantScoped:
    def test_group_by_tenant_or_an_exact_tenant_match(self, policy_factory: PolicyFactory) -> None:
        assert tenant_scoped(policy_factory(group_by=["tenant", "api_key"]))
        assert tenant_scoped(policy_factory(group_by=[], match={"tenant": "acme"}))

    def test_keys_that_may_span_tenants(self, policy_factory: PolicyFactory) -> None:
        assert not tenant_scoped(policy_factory(group_by=[]))
        assert not tenant_scoped(policy_factory(group_by=["model"]))
        for glob in ("acme-*", "acm?", "[ab]cme"):
            assert not tenant_scoped(policy_factory(group_by=[], match={"tenant": glob}))


class TestMarksFor:
    def test_a_tenant_key_needs_only_its_usage_partition(
        self, policy_factory: PolicyFactory
    ) -> None:
        topo = Topology(usage=4, keyed=8)
        marks = topo.marks_for(policy_factory(), "p|tenant=acme", b"acme")
        assert marks == (usage_mark(partition_for(b"acme", 4)),)

    def test_a_key_across_tenants_needs_every_usage_partition(
        self, policy_factory: PolicyFactory
    ) -> None:
        topo = Topology(usage=3, keyed=2)
        marks = topo.marks_for(policy_factory(group_by=[]), "g", b"acme")
        assert marks == ("usage:0", "usage:1", "usage:2", keyed_mark(partition_for(b"g", 2)))

    def test_topology_round_trips(self) -> None:
        topo = Topology(usage=4, keyed=6)
        assert Topology.decode(topo.encode().encode()) == topo
        assert len(topo.all_marks()) == 10
