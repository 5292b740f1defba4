"""The Redis key layout: one Redis as always, or 64 virtual shards by hash tag on a cluster."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from spendgate.schemas.events import Subject
from spendgate.schemas.layout import Layout
from spendgate.schemas.matching import budget_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import held_keys, request_key, reservation_key

ONE = Layout("sg:")
CLUSTER = Layout("sg:", cluster=True)


def policy(**fields: object) -> Policy:
    base: dict[str, object] = {"id": "p1", "limit": 10, "unit": "requests", "window": "1h"}
    return Policy.model_validate({**base, **fields})


def crc_shard(name: str) -> int:  # the definition: CRC-32 of the name, modulo 64
    return zlib.crc32(name.encode()) % 64


def test_one_redis_keeps_the_layout_it_always_had() -> None:
    p = policy(group_by=["tenant"])
    assert ONE.shards() == ("sg:",)
    assert ONE.of_key(p, "p1|tenant=acme") == "sg:"
    assert ONE.reservation_id(7, "abc") == "abc"
    assert ONE.of_reservation("abc") == "sg:"


def test_a_cluster_has_64_tags_after_the_prefix() -> None:
    shards = CLUSTER.shards()
    assert len(shards) == len(set(shards)) == 64
    assert shards[0] == "sg:{s0}" and shards[63] == "sg:{s63}"
    # 64 tags spread over a 3-master cluster's slot ranges (0-5460, 5461-10922, 10923-16383).
    slots = [key_slot(s.encode()) for s in shards]
    assert {slot * 3 // 16384 for slot in slots} == {0, 1, 2}
    with pytest.raises(ValueError, match=r"not in 0\.\.63"):
        CLUSTER.shard(64)


def test_tenant_scoped_keys_live_in_their_tenants_home_shard() -> None:
    grouped = policy(group_by=["tenant", "api_key"])
    pinned = policy(id="p2", match={"tenant": "acme"}, group_by=["api_key"])
    home = crc_shard("acme")
    assert CLUSTER.home_shard("acme") == home
    assert CLUSTER.key_shard(grouped, "p1|tenant=acme|api_key=k1") == home
    assert CLUSTER.key_shard(pinned, "p2|api_key=k1") == home
    assert CLUSTER.of_key(grouped, "p1|tenant=acme|api_key=k1") == f"sg:{{s{home}}}"


def test_keys_spanning_tenants_live_in_their_own_shard() -> None:
    per_model = policy(id="opus", group_by=["model"])
    glob = policy(id="ac", match={"tenant": "ac*"})
    assert CLUSTER.key_shard(per_model, "opus|model=m1") == crc_shard("opus|model=m1")
    assert CLUSTER.key_shard(glob, "ac") == crc_shard("ac")


names = st.text(min_size=1, max_size=20)


@given(tenant=names, api_key=names)
def test_no_subject_value_moves_a_key_out_of_its_shard(tenant: str, api_key: str) -> None:
    p = policy(group_by=["tenant", "api_key"])
    key = budget_key(p, Subject(tenant=tenant, api_key=api_key))
    shard = CLUSTER.of_key(p, key)
    want = key_slot(shard.encode())
    # Every key a script takes for this budget key, and the tenant's own bookkeeping.
    names = [*held_keys(shard, key), request_key(shard, tenant, "r1")]
    assert {key_slot(n.encode()) for n in names} == {want}
    assert shard == CLUSTER.shard(crc_shard(tenant))


def test_reservation_ids_name_their_home_shard() -> None:
    rid = CLUSTER.reservation_id(42, "0f3c")
    assert rid == "s42-0f3c"
    assert CLUSTER.of_reservation(rid) == "sg:{s42}"
    assert key_slot(reservation_key(CLUSTER.of_reservation(rid), rid).encode()) == key_slot(
        b"{s42}"
    )
    for bad in ("0f3c", "s64-0f3c", "x1-0f3c", "s-1"):
        with pytest.raises(ValueError, match="names no shard"):
            CLUSTER.of_reservation(bad)
