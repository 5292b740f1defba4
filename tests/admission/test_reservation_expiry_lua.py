"""A key holds at most one ``reservation_ttl`` of pending entries while nobody absorbs them,
and what admission expires itself stays counted until the worker's windows hold it.

One budget key driven through the real per-key steps (holds and reads of ``key_steps.lua``)
and ABSORB, on a clock the test sets (the Redis clock the admit script would read), so
minutes of steady admits take a fraction of a second. With the worker stopped, the
reservations a policy failing open keeps admitting must not pile up in Redis; those due
are expired by admission as the design's abandoned-reservation rule says: charged in full.

The oracle is the list of holds made: at a clock ``t`` a hold counts when it is in the
window ``(t - w, t]``, expired or not. The bound is the issue's: at rate ``R`` the entries
(and the expiry queue) never exceed ``R x reservation_ttl`` + 1 %.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from spendgate.schemas.window_codec import encode
from spendgate.streams.scripts import absorb
from spendgate.streams.scripts.absorb import AbsorbArgs, AbsorbKey
from tests.fixtures.embedded_lua import LuaServer, harness

KEY_CHECK = harness("key_check")
T0 = 1_700_000_000_000
HOUR, MINUTE = 3_600_000, 60_000
#: How far past the latest expiry the marks must vouch before expired amounts are cleared
#: (key_steps.lua EXPIRED_MARGIN_MS).
MARGIN_MS = 1000


class Key:
    """One budget key under a 1 h window of 1 min buckets, its holds as the oracle."""

    def __init__(
        self, lua: LuaServer, name: str, version: int, *, ttl_ms: int, window_ms: int = HOUR
    ) -> None:
        p = f"{lua.prefix}{name}"
        self.client = lua.client
        self.names = [f"{p}:{kind}" for kind in ("w", "pw", "pv", "pq", "pr", "pe")]
        self.unpublished = f"{p}:unpub"
        self.check = lua.script(KEY_CHECK)
        self.absorb = lua.script(absorb.SCRIPT.source)
        self.ttl_ms = ttl_ms
        self.window_ms = window_ms
        #: (instant, amount, id) of every hold made.
        self.holds: list[tuple[int, int, str]] = []
        # Holds go to the version-2 pending window once the worker wrote a version-2
        # window (the key existed before it stopped), else to version 1 (a new key).
        if version == 2:
            self.client.set(self.names[0], encode({}, MINUTE))
        self.window_hash = self.names[2] if version == 2 else self.names[1]
        self.entry_hash, self.prefix = (
            (self.names[2], b"r:") if version == 2 else (self.names[4], b"")
        )

    def _args(self, op: str, t: int, amount: int, last: str | int) -> list[str | int]:
        return [op, t, self.window_ms, MINUTE, "include", 10**12, amount, last, self.ttl_ms]

    def hold(self, t: int, amount: int, rid: str) -> None:
        self.check(keys=[*self.names, self.unpublished], args=self._args("hold", t, amount, rid))
        self.holds.append((t, amount, rid))

    def read(self, t: int, mark: int | None = None) -> int:
        """What the key counts at ``t``; ``mark``: the key's marks vouch up to it."""
        args = self._args("read", t, 1, 0)
        if mark is not None:
            args.append(mark)
        used, reserved = self.check(keys=self.names, args=args)[:2]
        return int(used) + int(reserved)

    def exact(self, t: int) -> int:
        """The holds the window counts at ``t`` (boundary ``include``: its whole oldest
        bucket)."""
        oldest = t - t % MINUTE - self.window_ms
        return sum(a for at, a, _ in self.holds if oldest <= at - at % MINUTE and at <= t)

    def entries(self) -> int:
        return sum(1 for f in self.client.hkeys(self.entry_hash) if f.startswith(self.prefix))

    def has_entry(self, rid: str) -> bool:
        return bool(self.client.hexists(self.entry_hash, self.prefix + rid.encode()))

    def queued(self) -> int:
        return int(self.client.llen(self.names[5]))

    def fields(self) -> dict[str, int]:
        """The pending window's fields (buckets, expired amounts, the sum...), both
        versions, entries left out."""
        held = {**self.client.hgetall(self.names[1]), **self.client.hgetall(self.names[2])}
        return {f.decode(): int(v) for f, v in held.items() if not f.startswith(b"r:")}

    def worker_absorbs_everything(self) -> None:
        """The worker comes back: its window holds every hold (charged, as expired or
        committed at the estimate) and ABSORB names every reservation."""
        buckets: dict[int, int] = {}
        for at, amount, _ in self.holds:
            start = at - at % MINUTE
            buckets[start] = buckets.get(start, 0) + amount
        w, pw, pv, pq, pr, _ = self.names
        part = AbsorbKey(
            w, pw, pv, pq, pr, f"{w}:v", f"{w}:u", encode(buckets, MINUTE), self.window_ms
        )
        ids = tuple(rid for _, _, rid in self.holds)
        args = AbsorbArgs([replace(part, reservation_ids=ids)])
        self.absorb(keys=args.keys(), args=args.argv())


def steady(
    key: Key, start: int, minutes: int, every_ms: int, amount: int = 3, seconds: int = 0
) -> int:
    """Hold ``amount`` every ``every_ms`` for ``minutes`` (or ``seconds``); returns the
    clock after."""
    t = start
    for i in range((seconds * 1000 or minutes * MINUTE) // every_ms):
        key.hold(t, amount, f"r{start}-{i}")
        t += every_ms
    return t


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def version(request: pytest.FixtureRequest) -> int:
    """Which pending window the holds go to."""
    return int(request.param)


class TestReservationExpiry:
    def test_a_key_holds_at_most_one_ttl_of_entries_while_nobody_absorbs(
        self, lua_server: LuaServer, version: int
    ) -> None:
        # The case: the worker stopped, a policy failing open admitting at R = 10/s,
        # reservation_ttl 1 min, 11 minutes of steady admits on real Redis (2 embedded:
        # the same script, slower).
        key = Key(lua_server, "steady", version, ttl_ms=MINUTE)
        every_ms = 100
        minutes = 11 if lua_server.backend == "redis" else 2
        bound = (MINUTE // every_ms) * 1.01
        t, worst_entries, worst_queued = T0, 0, 0
        for step in range(minutes * 6):  # checked every 10 s of the clock
            t = steady(key, t, 0, every_ms, seconds=10)
            worst_entries = max(worst_entries, key.entries())
            worst_queued = max(worst_queued, key.queued())
            # Nothing expired is lost: every hold still counts, charged in full.
            assert key.read(t) == key.exact(t), f"after {step * 10 + 10} s"
        assert len(key.holds) == minutes * 600
        print(
            f"{lua_server.backend} v{version}: {minutes} min at 10/s, TTL 1 min: at most "
            f"{worst_entries} entries and {worst_queued} queued (bound {bound:.0f})"
        )
        assert worst_entries <= bound, (worst_entries, bound)
        assert worst_queued <= bound, (worst_queued, bound)
        # Without expiry every hold would still be an entry.
        assert key.entries() >= MINUTE // every_ms - 1

    def test_expired_holds_count_until_the_worker_s_windows_hold_them(
        self, lua_server: LuaServer, version: int
    ) -> None:
        key = Key(lua_server, "back", version, ttl_ms=MINUTE)
        t = steady(key, T0, 4, 1000, amount=5)
        fields = key.fields()
        expired = sum(v for f, v in fields.items() if f.startswith("x:"))
        latest = int(fields["xt"])
        assert expired > 0 and key.read(t) == key.exact(t)
        key.worker_absorbs_everything()
        # Absorbed: the entries left moved; the expired amounts are counted in both the
        # window and the pending buckets until the marks vouch past the latest expiry:
        # never less than the ledger (a worker that is not caught up vouches for nothing).
        assert key.entries() == 0
        assert key.read(t, mark=latest + MARGIN_MS) == key.exact(t) + expired
        # The marks vouch past it: counted once again, and nothing is left pending.
        assert key.read(t, mark=latest + MARGIN_MS + 1) == key.exact(t)
        assert key.fields() == {}
        # And the key goes on as before.
        key.hold(t + 1, 7, "after")
        assert key.read(t + 1) == key.exact(t + 1)

    def test_a_hold_whose_reserve_is_unpublished_is_not_expired(
        self, lua_server: LuaServer, version: int
    ) -> None:
        key = Key(lua_server, "unpub", version, ttl_ms=MINUTE)
        lua_server.client.zadd(key.unpublished, {"first": T0})
        key.hold(T0, 4, "first")
        t = steady(key, T0 + 1000, 2, 1000)
        # Due for a minute, but Kafka never acked its reserve: still an entry.
        assert key.has_entry("first")
        lua_server.client.zrem(key.unpublished, "first")
        t = steady(key, t, 2, 1000)
        assert not key.has_entry("first")
        assert key.read(t) == key.exact(t)

    def test_expired_amounts_leave_with_their_buckets(
        self, lua_server: LuaServer, version: int
    ) -> None:
        # A 10 min window: buckets age out while their holds are expired amounts.
        key = Key(lua_server, "aging", version, ttl_ms=MINUTE, window_ms=10 * MINUTE)
        t = steady(key, T0, 15, 1000, amount=2)
        assert key.read(t) == key.exact(t)
        fields = key.fields()
        pending = {f for f in fields if f.isdigit()}
        assert any(f.startswith("x:") for f in fields)
        assert {f[2:] for f in fields if f.startswith("x:")} <= pending
        assert key.entries() <= 60 * 1.01
