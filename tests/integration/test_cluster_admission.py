"""Admission on a real Redis Cluster: requests on their home shard, requests spanning shards
decided piece by piece (``admission.pieces``), never over any limit, nothing left held.

The budgets: one per tenant (on the tenant's home shard) and one per model (a budget
that spans tenants: its own key's shard), so every request here spans two shards. The
oracle is what each test sent and Redis's own pending sums, read key by key.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from spendgate.admission import pieces
from spendgate.admission.app import create_app
from spendgate.admission.plans import Plan, Planner
from spendgate.admission.scripts.admit import AdmitResult
from spendgate.admission.server import budget_store, redis_client
from spendgate.admission.settings import AdmissionSettings
from spendgate.admission.store import BudgetStore
from spendgate.admission.sweeper import ReserveSweeper
from spendgate.devcluster import LocalCluster
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.layout import Layout, shard_of
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import (
    marks_key,
    provisional_key,
    reservation_key,
    tombstone_key,
    unpublished_reserves_key,
    window_key,
)
from spendgate.schemas.window_codec import encode
from spendgate.streams.materialize import RedisMaterializer
from tests.fixtures.admission import TOPOLOGY, VOUCHED, RecordingPublisher
from tests.fixtures.cluster import healed
from tests.fixtures.held import apending_sum

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

MODEL = "m1"
#: The per-model budget's key, and its shard (every request below touches it).
MODEL_KEY = f"per-model|model={MODEL}"


def _policies(tenant_limit: int, model_limit: int, **model: Any) -> list[Policy]:
    return [
        Policy.model_validate(
            {"id": "per-tenant", "limit": tenant_limit, "unit": "requests", "window": "1h",
             "group_by": ["tenant"]}
        ),
        Policy.model_validate(
            {"id": "per-model", "limit": model_limit, "unit": "requests", "window": "1h",
             "group_by": ["model"], **model}
        ),
    ]  # fmt: skip


def _tenants(count: int, *, before: bool | None = None) -> list[str]:
    """Tenants whose home shard is not the per-model key's (``before``: only those whose
    shard comes before it in the visiting order, or only after it)."""
    model_shard = shard_of(MODEL_KEY)
    out: list[str] = []
    i = 0
    while len(out) < count:
        tenant = f"team-{i}"
        home = shard_of(tenant)
        if home != model_shard and (before is None or (home < model_shard) == before):
            out.append(tenant)
        i += 1
    return out


def _tenant_key(tenant: str) -> str:
    return f"per-tenant|tenant={tenant}"


@dataclass
class Stack:
    """An admission app on the cluster, with what it published."""

    http: httpx.AsyncClient
    store: BudgetStore
    client: RedisCluster
    layout: Layout
    publisher: RecordingPublisher

    async def policies(self, policies: list[Policy]) -> None:
        materializer = RedisMaterializer(
            self.client,  # type: ignore[arg-type]
            self.layout.prefix,
            limit_of=lambda pid: next((p.limit for p in policies if p.id == pid), None),
            layout=self.layout,
            policy_of=lambda pid: next((p for p in policies if p.id == pid), None),
        )
        await materializer.stand_in(policies, TOPOLOGY, VOUCHED)
        self.store._checked = 0.0

    async def admit(
        self, tenant: str, request_id: str | None = None, model: str = MODEL, **estimate: int
    ) -> httpx.Response:
        return await self.http.post(
            "/v1/admit",
            json={
                "request_id": request_id or uuid.uuid4().hex,
                "subject": {"tenant": tenant, "model": model},
                "estimate": estimate or {"requests": 1},
            },
        )

    async def held(self, policy_key: str, tenant: str | None = None) -> int:
        """What Redis holds pending on a budget key (on its shard)."""
        shard = self.layout.shard(shard_of(tenant) if tenant is not None else shard_of(policy_key))
        return await apending_sum(self.client, shard, policy_key)  # type: ignore[arg-type]

    async def redis_ms(self, policy_key: str) -> int:
        """The Redis clock (TIME, in ms) of the node holding ``policy_key``'s window (not
        grouped by tenant): the clock the scripts deciding on that key read."""
        node = self.client.get_node_from_key(
            window_key(self.layout.shard(shard_of(policy_key)), policy_key)
        )
        seconds, micros = await self.client.time(target_nodes=node)
        return seconds * 1000 + micros // 1000

    async def usage(self, policy_key: str, buckets: dict[int, int], bucket_ms: int) -> None:
        """Write a window not grouped by tenant (on its key's shard) as the worker would."""
        shard = self.layout.shard(shard_of(policy_key))
        await self.client.set(window_key(shard, policy_key), encode(buckets, bucket_ms))

    def sweeper(self) -> ReserveSweeper:
        return ReserveSweeper(
            self.client,  # type: ignore[arg-type]
            self.layout.prefix,
            self.publisher,
            grace_s=0.0,
            layout=self.layout,
        )


@pytest.fixture
async def stack(
    redis_cluster: LocalCluster, cluster_prefix: str
) -> AsyncIterator[Callable[..., Any]]:
    opened: list[Stack] = []

    async def make(**overrides: Any) -> Stack:
        settings = AdmissionSettings(
            redis_url=redis_cluster.url,
            redis_cluster=True,
            redis_prefix=cluster_prefix,
            redis_timeout_s=5.0,
            redis_down_s=0.0,
            policy_refresh_s=0.05,
            **overrides,
        )
        client = redis_client(settings)
        await client.initialize()  # type: ignore[attr-defined]
        store = budget_store(settings, client)
        publisher = RecordingPublisher()
        app = create_app(store, publisher)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://adm")
        made = Stack(http, store, client, store.layout, publisher)  # type: ignore[arg-type]
        opened.append(made)
        return made

    yield make
    for made in opened:
        keys = [k async for k in made.client.scan_iter(match=f"{cluster_prefix}*", count=1000)]
        for key in keys:
            await made.client.delete(key)
        await made.http.aclose()
        await made.client.aclose()


async def test_a_request_on_its_home_shard_is_one_script_call_there(stack: Any) -> None:
    s: Stack = await stack()
    tenant = "solo"
    await s.policies(_policies(2, 100)[:1])
    first = await s.admit(tenant)
    assert first.status_code == 200, first.text
    rid = first.json()["reservation_id"]
    home = shard_of(tenant)
    assert rid.startswith(f"s{home}-")
    assert await s.client.exists(reservation_key(s.layout.shard(home), rid)) == 1
    assert await s.held(_tenant_key(tenant), tenant) == 1
    assert (await s.admit(tenant)).status_code == 200
    third = await s.admit(tenant)
    assert third.status_code == 429
    commit = await s.http.post("/v1/commit", json={"reservation_id": rid, "usage": {"requests": 1}})
    assert commit.status_code == 202, commit.text
    assert s.publisher.kinds() == ["reserve", "reserve", "commit"]


async def test_racing_requests_across_shards_admit_exactly_the_shared_limit(stack: Any) -> None:
    s: Stack = await stack()
    tenants = _tenants(8)
    await s.policies(_policies(1_000, 60))
    answers = await asyncio.gather(*(s.admit(tenants[i % 8]) for i in range(200)))
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 429}
    assert codes.count(200) == 60
    assert await s.held(MODEL_KEY) == 60
    for tenant in tenants:
        mine = sum(
            1 for i, a in enumerate(answers) if tenants[i % 8] == tenant and a.status_code == 200
        )
        assert await s.held(_tenant_key(tenant), tenant) == mine
    refused = [a.json() for a in answers if a.status_code == 429]
    assert all(r["violated"] == ["per-model"] for r in refused)
    # Nothing is left provisional: every admitted request was sealed and unlisted, every
    # refused one released, and no piece record stays behind on any shard.
    for shard in s.layout.shards():
        assert await s.client.zcard(provisional_key(shard)) == 0
    left = [k async for k in s.client.scan_iter(match=f"{s.layout.prefix}*piece:*")]
    assert left == []
    assert s.publisher.kinds().count("reserve") == 60


async def test_a_hierarchy_never_goes_over_and_releases_what_it_refused(stack: Any) -> None:
    s: Stack = await stack()
    tenants = _tenants(8)
    await s.policies(_policies(10, 60))
    answers = await asyncio.gather(*(s.admit(tenants[i % 8]) for i in range(200)))
    admitted = {t: 0 for t in tenants}
    for i, a in enumerate(answers):
        assert a.status_code in (200, 429), a.text
        if a.status_code == 200:
            admitted[tenants[i % 8]] += 1
    assert sum(admitted.values()) <= 60
    assert all(n <= 10 for n in admitted.values())
    # Every hold is an admitted request's: the refused ones released their pieces.
    assert await s.held(MODEL_KEY) == sum(admitted.values())
    for tenant in tenants:
        assert await s.held(_tenant_key(tenant), tenant) == admitted[tenant]
    # Asked one by one afterwards, the budgets fill to exactly their limits.
    for _ in range(12):
        for tenant in tenants:
            if (await s.admit(tenant)).status_code == 200:
                admitted[tenant] += 1
    assert sum(admitted.values()) == 60
    assert await s.held(MODEL_KEY) == 60


@pytest.mark.parametrize("before", [True, False], ids=["home-first", "home-last"])
async def test_a_later_shard_refusing_releases_the_earlier_piece(stack: Any, before: bool) -> None:
    s: Stack = await stack()
    tenant = _tenants(1, before=before)[0]
    await s.policies(_policies(5, 1))
    assert (await s.admit("filler-" + tenant)).status_code == 200
    refused = await s.admit(tenant)
    assert refused.status_code == 429, refused.text
    body = refused.json()
    assert body["violated"] == ["per-model"]
    assert await s.held(_tenant_key(tenant), tenant) == 0
    assert await s.held(MODEL_KEY) == 1
    budgets = {b["policy"]: b for b in body["budgets"]}
    assert set(budgets) == {"per-tenant", "per-model"}
    # Read where each key lives: the tenant's (its piece released, or never held) and the
    # model's, full.
    assert budgets["per-tenant"]["used"] == 0
    assert budgets["per-model"]["used"] + budgets["per-model"]["reserved"] == 1


async def test_a_repeated_request_id_gets_its_first_answer_and_holds_once(stack: Any) -> None:
    s: Stack = await stack()
    tenant = _tenants(1)[0]
    # Room for every racing copy's pieces at once: copies racing each hold their pieces
    # until the first seals (then the others release theirs), so a tighter limit could
    # refuse one spuriously, which the protocol allows and this test is not about.
    await s.policies(_policies(10, 10))
    rid = uuid.uuid4().hex
    first, again = await s.admit(tenant, rid), await s.admit(tenant, rid)
    assert first.status_code == again.status_code == 200
    assert first.json()["reservation_id"] == again.json()["reservation_id"]
    racing = await asyncio.gather(*(s.admit(tenant, "race") for _ in range(5)))
    assert len({r.json()["reservation_id"] for r in racing}) == 1
    assert await s.held(MODEL_KEY) == 2
    assert await s.held(_tenant_key(tenant), tenant) == 2


async def _crashed_after_first_piece(
    s: Stack, tenant: str
) -> tuple[list[Plan], str, pieces.Piece, AdmitResult]:
    """Hold the first piece of a request for ``tenant`` and nothing more, as an admission
    process that died between shards: the plans, the reservation id, the piece, its
    answer."""
    subject = Subject(tenant=tenant, model=MODEL)
    plans = Planner(await s.store.policies(), None).plans(subject, Usage(requests=1))
    rid = s.store.new_reservation_id(tenant, uuid.uuid4().hex)
    first = pieces.split(s.store, plans[0])[0]
    result = await pieces._decide_piece(
        s.store, first, plans[0], "crashed", rid, 0, hold=True, estimate_output=0
    )
    return plans, rid, first, result


async def test_a_crash_between_shards_is_released_by_the_sweeper(stack: Any) -> None:
    s: Stack = await stack()
    tenant = _tenants(1)[0]
    await s.policies(_policies(5, 5))
    # The first piece of a request, held as an admission process does before it dies.
    plans, rid, first, result = await _crashed_after_first_piece(s, tenant)
    assert result.outcome == "allow"
    held_key = first.charges[0].target.key
    on = s.layout.shard(first.shard)
    assert await s.client.zscore(provisional_key(on), rid) is not None
    # Before its deadline the sweeper leaves it alone; past it, it aborts and releases.
    sweeper = s.sweeper()
    assert await sweeper.sweep_pieces() == 0
    assert await sweeper.sweep_pieces(now_ms=VOUCHED) == 1
    home = s.layout.shard(shard_of(tenant))
    assert await s.client.exists(tombstone_key(home, rid)) == 1
    assert await s.client.zcard(provisional_key(on)) == 0
    tenant_of_key = tenant if held_key == _tenant_key(tenant) else None
    assert await s.held(held_key, tenant_of_key) == 0
    # The request's own process, had it lived on, could no longer seal it.
    reply = await pieces.seal(s.store, plans[0], "crashed", result, Usage(requests=1))
    assert reply.status == "tombstoned"
    assert await s.client.exists(reservation_key(home, rid)) == 0


async def test_a_sealed_reservation_whose_pieces_stayed_listed_is_only_unlisted(
    stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s: Stack = await stack()
    tenant = _tenants(1)[0]
    await s.policies(_policies(5, 5))

    async def crashed(*_: Any) -> None:
        return None

    monkeypatch.setattr(pieces, "_unlist", crashed)
    admitted = await s.admit(tenant)
    assert admitted.status_code == 200
    rid = admitted.json()["reservation_id"]
    listed = [p for p in s.layout.shards() if await s.client.zscore(provisional_key(p), rid)]
    assert listed == [s.layout.shard(shard_of(MODEL_KEY))]
    assert await s.sweeper().sweep_pieces(now_ms=VOUCHED) == 1
    assert await s.held(MODEL_KEY) == 1
    assert await s.held(_tenant_key(tenant), tenant) == 1
    home = s.layout.shard(shard_of(tenant))
    assert await s.client.zscore(unpublished_reserves_key(home), rid) is not None


async def test_unpublished_reserves_are_republished_from_their_shards(stack: Any) -> None:
    s: Stack = await stack()
    tenants = _tenants(3)
    await s.policies(_policies(5, 5))
    rids = []
    for tenant in tenants:
        answer = await s.admit(tenant)
        assert answer.status_code == 200
        rids.append(answer.json()["reservation_id"])
    s.publisher.events.clear()
    sweeper = s.sweeper()
    assert await sweeper.sweep() == 3
    assert sorted(e.reservation_id for e in s.publisher.events) == sorted(rids)  # type: ignore[attr-defined]
    for event in s.publisher.events:
        sweeper.acked(event)
    assert await sweeper.flush_acked() == 3
    for tenant in tenants:
        home = s.layout.shard(shard_of(tenant))
        assert await s.client.zcard(unpublished_reserves_key(home)) == 0


async def test_a_hold_no_replica_acknowledged_is_answered_by_the_failure_mode(
    stack: Any,
) -> None:
    # Every master here has one replica: asking for two can never be met in time.
    s: Stack = await stack(redis_wait_replicas=2, redis_wait_ms=20)
    tenant = _tenants(1)[0]
    await s.policies(_policies(5, 5))
    answer = await s.admit(tenant)
    assert answer.status_code == 503, answer.text
    assert "replicas" in answer.json()["error"]["message"]
    assert s.publisher.kinds() == []
    # With the one replica there is, the same request is answered (and durable).
    ok: Stack = await stack(redis_wait_replicas=1)
    assert (await ok.admit(tenant)).status_code == 200


async def test_a_master_killed_under_load_fails_over_and_never_admits_over(
    stack: Any, redis_cluster: LocalCluster
) -> None:
    s: Stack = await stack()
    tenants = _tenants(8)
    limit = 120
    await s.policies(_policies(10_000, limit))
    shard = s.layout.shard(shard_of(MODEL_KEY))
    master = s.client.get_node_from_key(marks_key(shard)).port  # type: ignore[union-attr]
    pid = redis_cluster.pid(master)
    assert pid is not None
    answers: list[tuple[str, int, str]] = []

    async def load(phase: str, count: int) -> None:
        async def one(i: int) -> None:
            r = await s.admit(tenants[i % 8])
            answers.append((phase, r.status_code, r.text))

        for start in range(0, count, 4):
            await asyncio.gather(*(one(i) for i in range(start, min(count, start + 4))))

    try:
        await load("before", 40)
        os.kill(pid, signal.SIGKILL)
        # Under load through the failover: the shard's requests answer by the failure
        # mode (closed: 503), first while its master is gone, then while its promoted
        # replica has no replica of its own to acknowledge a hold.
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            await load("failover", 4)
            if "replicas" in answers[-1][2]:
                break
            await asyncio.sleep(0.2)
        # The killed node comes back as the new master's replica: decided again.
        healed(redis_cluster)
        await load("after", 200)
    finally:
        healed(redis_cluster)
    codes = {p: [c for q, c, _ in answers if q == p] for p in ("before", "failover", "after")}
    assert codes["before"] == [200] * 40
    assert set(codes["failover"]) == {503}
    assert "replicas" in answers[len(codes["before"]) + len(codes["failover"]) - 1][2]
    assert set(codes["after"]) == {200, 429}
    admitted = sum(1 for _, c, _ in answers if c == 200)
    held = await s.held(MODEL_KEY)
    # None over the limit; none answered lost by the promoted replica (holds of steps
    # answered by the failure mode may stand beside them: never fewer).
    assert admitted <= held <= limit
    assert codes["after"][-1] == 429
    assert s.client.get_node_from_key(marks_key(shard)).port != master  # type: ignore[union-attr]


def _policy(pid: str, group_by: str, limit: int, unit: str = "requests", **fields: Any) -> Policy:
    return Policy.model_validate(
        {"id": pid, "limit": limit, "unit": unit, "window": "1h", "group_by": [group_by],
         **fields}
    )  # fmt: skip


@pytest.mark.parametrize("before", [True, False], ids=["tenant-first", "tenant-last"])
async def test_cap_across_shards_takes_the_lowest_output_and_holds_it_after(
    stack: Any, before: bool
) -> None:
    s: Stack = await stack()
    tenant = _tenants(1, before=before)[0]
    await s.policies(
        [
            _policy("per-tenant", "tenant", 10_000, "total_tokens", on_exceed="cap"),
            _policy("per-model", "model", 1000, "total_tokens", on_exceed="cap"),
        ]
    )
    tenant_key = f"per-tenant|tenant={tenant}"
    assert (await s.admit(tenant, input_tokens=100, output_tokens=500)).status_code == 200
    answer = await s.admit(tenant, input_tokens=100, output_tokens=500)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["decision"], body["max_output_tokens"]) == ("cap", 300)  # 1000 - 600 - 100
    assert s.publisher.events[-1].usage.output_tokens == 300  # type: ignore[attr-defined]
    assert await s.held(MODEL_KEY) == 1000
    # The tenant's piece holds 100 + 300 when the model's came first (it set the cap);
    # decided first, at the whole estimate, it holds 600 until the worker absorbs it.
    assert await s.held(tenant_key, tenant) == 600 + (600 if before else 400)


async def test_downgrade_across_shards_tries_the_alternative_as_a_plan_of_its_own(
    stack: Any,
) -> None:
    s: Stack = await stack()
    tenant = _tenants(1)[0]
    await s.policies(
        [
            _policy("per-tenant", "tenant", 100),
            _policy(
                "big", "model", 2, match={"model": "big"}, on_exceed="downgrade",
                downgrade_to="small",
            ),
            _policy("small", "model", 1, match={"model": "small"}),
        ]
    )  # fmt: skip
    decisions = []
    for _ in range(4):
        answer = await s.admit(tenant, model="big")
        body = answer.json()
        decisions.append((answer.status_code, body["decision"], body.get("model")))
    assert decisions == [
        (200, "allow", "big"),
        (200, "allow", "big"),
        (200, "downgrade", "small"),
        (429, "reject", "big"),
    ]
    assert await s.held("big|model=big") == 2
    assert await s.held("small|model=small") == 1
    # Three admitted; the refused request's plans were released on every shard.
    assert await s.held(f"per-tenant|tenant={tenant}", tenant) == 3
    models = [e.subject.model for e in s.publisher.events]  # type: ignore[attr-defined]
    assert models == ["big", "big", "small"]


async def test_route_across_shards_is_the_downgrade_protocol_on_the_pool(stack: Any) -> None:
    s: Stack = await stack()
    tenant = _tenants(1)[0]
    await s.policies(
        [
            _policy("per-tenant", "tenant", 100),
            _policy("east", "pool", 1, match={"pool": "east"}, on_exceed="route", route_to="west"),
        ]
    )
    sent = []
    for _ in range(2):
        answer = await s.http.post(
            "/v1/admit",
            json={
                "request_id": uuid.uuid4().hex,
                "subject": {"tenant": tenant, "model": MODEL, "pool": "east"},
                "estimate": {"requests": 1},
            },
        )
        body = answer.json()
        sent.append((answer.status_code, body["decision"], body.get("route_to")))
    assert sent == [(200, "allow", None), (200, "route", "west")]
    assert await s.held("east|pool=east") == 1
    assert await s.held(f"per-tenant|tenant={tenant}", tenant) == 2


async def test_burst_across_shards_admits_what_the_bucket_holds(stack: Any) -> None:
    s: Stack = await stack()
    tenants = _tenants(6)
    await s.policies(
        [
            _policy("per-tenant", "tenant", 100),
            _policy("per-model", "model", 1000, burst={"rate": 1, "per": "1h", "capacity": 3}),
        ]
    )
    answers = await asyncio.gather(*(s.admit(t) for t in tenants))
    assert sorted(a.status_code for a in answers) == [200, 200, 200, 429, 429, 429]
    refused = next(a for a in answers if a.status_code == 429).json()
    assert refused["violated"] == ["per-model"]
    assert await s.held(MODEL_KEY) == 3
    for tenant, answer in zip(tenants, answers, strict=True):
        assert await s.held(_tenant_key(tenant), tenant) == int(answer.status_code == 200)


async def test_a_released_piece_does_not_give_its_tokens_back(stack: Any) -> None:
    s: Stack = await stack()
    # The model's shard first: its piece takes a token, then the tenant's refuses.
    tenant = _tenants(1, before=False)[0]
    await s.policies(
        [
            _policy("per-tenant", "tenant", 1),
            _policy("per-model", "model", 1000, burst={"rate": 1, "per": "1h", "capacity": 5}),
        ]
    )
    assert (await s.admit(tenant)).status_code == 200
    refused = await s.admit(tenant)
    assert refused.status_code == 429 and refused.json()["violated"] == ["per-tenant"]
    assert await s.held(MODEL_KEY) == 1  # the window's hold released ...
    budgets = (await s.admit("another-" + tenant)).json()["budgets"]
    burst = next(b for b in budgets if b["policy"] == "per-model")["burst"]
    # ... the token not: 5 - 1 admitted - 1 taken by the released piece - 1 now.
    assert (burst["capacity"], burst["remaining"]) == (5, 2)


async def test_delay_across_shards_holds_until_the_shared_window_frees(stack: Any) -> None:
    s: Stack = await stack()
    tenants = _tenants(4)
    window_ms, bucket_ms = 30_000, 1000
    await s.policies(
        [
            _policy("per-tenant", "tenant", 100),
            Policy.model_validate(
                {"id": "per-model", "limit": 5, "unit": "requests", "window": "30s",
                 "bucket": "1s", "group_by": ["model"], "on_exceed": "delay",
                 "max_delay": "10s"}
            ),
        ]
    )  # fmt: skip
    # The shared window full with a bucket that leaves it in about 3 s by the clock the
    # admit script decides it by: the Redis clock (TIME) of the node holding it.
    now = await s.redis_ms(MODEL_KEY)
    bucket = now - now % bucket_ms + 3000 - window_ms - bucket_ms
    await s.usage(MODEL_KEY, {bucket: 5}, bucket_ms)
    # The first instant the bucket no longer counts (``include``: the boundary bucket counts
    # while it overlaps the window by a millisecond or more).
    fits_at = bucket + window_ms + bucket_ms - 1
    answers = await asyncio.gather(*(s.admit(tenants[i % 4]) for i in range(20)))
    admitted = [a for a in answers if a.status_code == 200]
    assert len(admitted) == 5
    assert all(a.json()["delayed_ms"] > 0 for a in admitted)
    # Held until the window freed, on that node's clock: each admitted request's admission
    # instant (the scripts' TIME, carried by its reserve event) is not before it ...
    reserves = {e.reservation_id: e for e in s.publisher.events if e.kind == "reserve"}
    assert set(reserves) == {a.json()["reservation_id"] for a in admitted}
    admitted_at = [round(e.occurred_at.timestamp() * 1000) for e in reserves.values()]
    assert min(admitted_at) >= fits_at, (admitted_at, fits_at)
    # ... and nothing was answered before it.
    assert await s.redis_ms(MODEL_KEY) >= fits_at
    assert await s.held(MODEL_KEY) == 5
    assert sum([await s.held(_tenant_key(t), t) for t in tenants]) == 5


async def test_status_reads_the_marks_of_the_control_shard(stack: Any) -> None:
    s: Stack = await stack()
    await s.policies(_policies(5, 5))
    answer = await s.http.get("/v1/status")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["decidable"] is True
    assert body["policies"] == 2
    assert len(body["partitions"]) == len(TOPOLOGY.all_marks())


async def _extend(s: Stack, rid: str, seq: int, **add: int) -> httpx.Response:
    body = {"reservation_id": rid, "seq": seq, "add": add}
    return await s.http.post("/v1/extend", json=body)


@pytest.mark.parametrize("before", [True, False], ids=["tenant-first", "tenant-last"])
async def test_an_extend_across_shards_grows_every_budget_or_none(stack: Any, before: bool) -> None:
    s: Stack = await stack()
    tenant = _tenants(1, before=before)[0]
    tenant_key = f"per-tenant|tenant={tenant}"
    await s.policies(
        [
            _policy("per-tenant", "tenant", 2000, "total_tokens"),
            _policy("per-model", "model", 1000, "total_tokens"),
        ]
    )
    admitted = await s.admit(tenant, input_tokens=100, output_tokens=0)
    assert admitted.status_code == 200, admitted.text
    rid = admitted.json()["reservation_id"]
    grown = await _extend(s, rid, 1, output_tokens=200)
    assert grown.status_code == 200, grown.text
    assert {b["policy"]: b["reserved"] for b in grown.json()["budgets"]} == {
        "per-tenant": 300,
        "per-model": 300,
    }
    assert (await s.held(MODEL_KEY), await s.held(tenant_key, tenant)) == (300, 300)
    # Past the model's limit: refused, and the tenant's piece (held or not) released.
    refused = await _extend(s, rid, 2, output_tokens=800)
    assert refused.status_code == 429, refused.text
    assert refused.json()["violated"] == ["per-model"]
    assert (await s.held(MODEL_KEY), await s.held(tenant_key, tenant)) == (300, 300)
    # A repeat of an answered seq replays it and grows nothing.
    again = await _extend(s, rid, 1, output_tokens=200)
    assert again.status_code == 200 and again.json() == grown.json()
    assert (await s.held(MODEL_KEY), await s.held(tenant_key, tenant)) == (300, 300)
    kinds = s.publisher.kinds()
    assert kinds.count("extend") == 2  # the first and its repeat (the same event id)
    # Settled: an extend is refused at the seal, and what its pieces held is released.
    released = await s.http.post("/v1/release", json={"reservation_id": rid})
    assert released.status_code == 202, released.text
    late = await _extend(s, rid, 3, output_tokens=10)
    assert late.status_code == 409, late.text
    assert (await s.held(MODEL_KEY), await s.held(tenant_key, tenant)) == (300, 300)


async def test_a_durable_step_sent_to_a_node_that_lost_its_slot_is_a_store_failure(
    cluster_client: RedisCluster, cluster_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    from spendgate.admission.replicated import run_replicated
    from spendgate.schemas.luascript import LuaScript

    client = cluster_client
    key = f"{cluster_prefix}{{s3}}probe"
    owner = client.get_node_from_key(key)
    assert owner is not None
    other = next(n for n in client.get_primaries() if n.name != owner.name)
    # A stale view of the cluster (as after a failover): the step reaches a master that
    # answers MOVED; it is a store failure (the failure modes answer), never a 500.
    monkeypatch.setattr(client, "get_node_from_key", lambda *_a, **_k: other)
    write = LuaScript("probe", "return redis.call('INCR', KEYS[1])")
    with pytest.raises(RedisConnectionError, match="cannot serve the slot"):
        await run_replicated(client, write, [key], [], replicas=0, timeout_ms=10)
    monkeypatch.undo()
    assert await run_replicated(client, write, [key], [], replicas=1, timeout_ms=1000) == 1
    await client.delete(key)


async def test_a_sweep_resolves_the_other_shards_when_one_fails(
    stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    s: Stack = await stack()
    tenant = _tenants(1)[0]
    await s.policies(_policies(5, 5))
    _, _, first, _ = await _crashed_after_first_piece(s, tenant)
    broken = s.layout.shard((first.shard + 1) % 64)
    real = s.client.zrangebyscore

    async def failing(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == provisional_key(broken):
            raise RedisConnectionError("this shard's master is unreachable")
        return await real(name, *args, **kwargs)

    monkeypatch.setattr(s.client, "zrangebyscore", failing)
    sweeper = s.sweeper()
    with pytest.raises(RedisConnectionError):
        await sweeper.sweep_pieces(now_ms=VOUCHED)
    # The failing shard did not stop the others: the abandoned piece is released.
    assert await s.client.zcard(provisional_key(s.layout.shard(first.shard))) == 0
    key = first.charges[0].target.key
    assert await s.held(key, tenant if key == _tenant_key(tenant) else None) == 0


async def test_a_bucket_width_change_keeps_a_full_budget_full(stack: Any) -> None:
    # A 1 h budget of 1 h buckets, full with absorbed usage and pending reservations on its
    # shard, re-applied with 1 min buckets: both moved to the hour's last minute, which has
    # not begun, and both count at once (README: policy edits).
    s: Stack = await stack()
    tenants = _tenants(4)
    await s.policies(_policies(1_000, 30, bucket="1h"))
    now = await s.redis_ms(MODEL_KEY)
    await s.usage(MODEL_KEY, {now - now % 3_600_000: 10}, 3_600_000)
    answers = await asyncio.gather(*(s.admit(tenants[i % 4]) for i in range(40)))
    assert [a.status_code for a in answers].count(200) == 20
    await s.policies(_policies(1_000, 30, bucket="1m"))
    probes = await asyncio.gather(*(s.admit(tenants[i % 4]) for i in range(20)))
    assert [p.status_code for p in probes] == [429] * 20
    assert {v for p in probes for v in p.json()["violated"]} == {"per-model"}
