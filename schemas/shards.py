"""Which worker partitions a budget key's window depends on, and the marks that vouch for them.

The worker writes, per partition it owns, an *applied mark* into one Redis hash
(:func:`schemas.redis_keys.marks_key`): field = :func:`usage_mark` or :func:`keyed_mark`,
value = the applied watermark in ms (every record of that partition up to that instant is
in Redis; the present while the worker is caught up). A field exists only while the
worker vouches for every window of its partition: it is written once those windows are
written or restored, and a loss of Redis data takes it away with them. The admission
script reads the fields a request's keys depend on, in the same atomic step as its
decision (``admission/scripts/admit.lua``).

Partitions are found the way the Kafka producers place records: murmur2 of the record key,
like the Java client's and aiokafka's default partitioner. A usage record is keyed by its
tenant (:func:`schemas.events.partition_key`); a keyed record by its budget key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from spendgate.schemas.matching import is_exact
from spendgate.schemas.policies import Policy

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of ``data`` (``org.apache.kafka.common.utils.Utils.murmur2``)."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a record keyed ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def usage_mark(partition: int) -> str:
    """The mark field of one partition of the usage topic."""
    return f"usage:{partition}"


def keyed_mark(partition: int) -> str:
    """The mark field of one partition of the repartition (keyed) topic."""
    return f"keyed:{partition}"


def tenant_scoped(policy: Policy) -> bool:
    """Whether every event counted by one of ``policy``'s keys comes from one tenant.

    True when the policy groups by tenant, or its ``match`` pins the tenant to one exact
    value (no glob): all such events share a usage partition.
    """
    return "tenant" in policy.group_by or is_exact(policy.match.get("tenant", "*"))


def tenant_of(policy: Policy, fields: Mapping[str, str]) -> str | None:
    """The tenant a budget key belongs to: its ``tenant`` group-by value, else the
    policy's exact ``match`` on tenant; ``None`` (operators only) when neither pins one."""
    if "tenant" in fields:
        return fields["tenant"]
    pattern = policy.match.get("tenant")
    return pattern if pattern is not None and is_exact(pattern) else None


@dataclass(frozen=True, slots=True)
class Topology:
    """Partition counts of the topics the windows are computed from."""

    usage: int
    keyed: int

    def encode(self) -> str:
        """The value stored in Redis (:func:`schemas.redis_keys.topology_key`)."""
        return f"{self.usage},{self.keyed}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Topology:
        """Inverse of :meth:`encode`."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        usage, keyed = text.split(",")
        return cls(int(usage), int(keyed))

    def all_usage_marks(self) -> tuple[str, ...]:
        """Every usage partition's mark."""
        return tuple(usage_mark(p) for p in range(self.usage))

    def all_marks(self) -> tuple[str, ...]:
        """Every partition's mark."""
        return (*self.all_usage_marks(), *(keyed_mark(p) for p in range(self.keyed)))

    def marks_for(self, policy: Policy, key: str, tenant_key: bytes) -> tuple[str, ...]:
        """The marks a window of ``policy`` under budget key ``key`` depends on.

        A tenant-scoped key is accounted in the usage partition of its tenant (the
        usage record's key): that partition's mark alone. Any other key is accounted from
        the keyed topic (its partition by the key), fed by every usage partition.
        """
        if tenant_scoped(policy):
            return (usage_mark(partition_for(tenant_key, self.usage)),)
        return (*self.all_usage_marks(), keyed_mark(partition_for(key.encode(), self.keyed)))
