"""The dashboard's JSON API on real Redis: sign-in, tenant isolation, the index's top-N."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from spendgate.admission.auth import OPERATOR, Authorizer
from spendgate.dashboard.app import COOKIE, create_app
from spendgate.dashboard.feeds import Scraper, TopicFeed
from spendgate.dashboard.reader import BudgetReader
from spendgate.schemas import window_codec
from spendgate.schemas.alerts import Alert
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import utilization_key, window_key
from spendgate.schemas.refusals import Refusal
from spendgate.schemas.windows import WindowSpec
from spendgate.streams.fold import KeyWrite
from spendgate.streams.ledger import KeyState
from spendgate.streams.materialize import RedisMaterializer

#: A broker nobody listens on: the feeds only ever fail to connect.
NOWHERE = KafkaConnection(bootstrap="127.0.0.1:1")

pytestmark = pytest.mark.integration

TOKENS = {"tok-a": frozenset({"a"}), "tok-b": frozenset({"b"}), "tok-ops": OPERATOR}
PER_TENANT = Policy.model_validate(
    {
        "id": "per-tenant",
        "unit": "requests",
        "limit": 100,
        "window": "1h",
        "bucket": "1m",
        "group_by": ["tenant", "api_key"],
    }
)
GLOBAL = Policy.model_validate(
    {"id": "global", "unit": "requests", "limit": 100_000, "window": "1h", "bucket": "1m"}
)


async def _now_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def seed(client: aioredis.Redis, prefix: str, used: dict[str, int]) -> None:
    """Write windows as the worker does (index included): key -> amount in the head bucket."""
    limits = {p.id: p.limit for p in (PER_TENANT, GLOBAL)}
    materializer = RedisMaterializer(client, prefix, limit_of=limits.get)
    await materializer.write_policies([PER_TENANT, GLOBAL])
    now = await _now_ms(client)
    spec = WindowSpec(3_600_000, 60_000)
    writes = []
    for i, (key, amount) in enumerate(used.items()):
        state = KeyState(buckets={now - now % 60_000: amount}, bucket_ms=60_000)
        state.window_ms, state.high_ms, state.offsets = 3_600_000, now, {0: i}
        writes.append(KeyWrite(key, state, spec, True, True))
    await materializer.write_batch(writes)


@pytest.fixture
async def dash(
    redis_client: aioredis.Redis, key_prefix: str
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any]]]:
    feeds: dict[str, Any] = {
        "alerts": TopicFeed(NOWHERE, "none", Alert, 50),
        "refusals": TopicFeed(NOWHERE, "none", Refusal, 50),
    }
    app = create_app(
        BudgetReader(redis_client, key_prefix),
        Authorizer(TOKENS),
        feeds["alerts"],
        feeds["refusals"],
        Scraper("http://127.0.0.1:1/metrics", "http://127.0.0.1:1/metrics", 1.0),
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dash") as http:
        yield http, feeds


async def sign_in(http: httpx.AsyncClient, token: str) -> httpx.Response:
    http.cookies.clear()
    return await http.post("/api/session", json={"token": token})


class TestSignIn:
    async def test_a_token_buys_an_http_only_session_cookie(
        self, dash: tuple[httpx.AsyncClient, dict[str, Any]]
    ) -> None:
        http, _ = dash
        assert (await http.get("/api/budgets")).status_code == 401
        assert (await http.get("/api/me")).json() == {"signed_in": False, "auth": True}
        bad = await sign_in(http, "nope")
        assert bad.status_code == 401 and bad.json()["error"]["field"] == "token"
        ok = await sign_in(http, "tok-a")
        assert ok.status_code == 200
        cookie = ok.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=") and "tok-a" not in cookie
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert (await http.get("/api/me")).json()["tenants"] == ["a"]
        assert (await http.get("/api/budgets")).status_code == 200
        await http.delete("/api/session")
        assert (await http.get("/api/budgets")).status_code == 401

    async def test_the_page_and_its_assets_are_served_by_the_package(
        self, dash: tuple[httpx.AsyncClient, dict[str, Any]]
    ) -> None:
        http, _ = dash
        page = await http.get("/")
        assert (
            page.status_code == 200
            and "default-src 'self'" in page.headers["content-security-policy"]
        )
        for asset in ("/static/app.js", "/static/app.css"):
            assert (await http.get(asset)).status_code == 200
        assert "http" not in page.text.replace("http-equiv", "").lower().split("<body")[0]


class TestTenants:
    async def test_a_tenant_token_never_sees_another_tenant(
        self,
        dash: tuple[httpx.AsyncClient, dict[str, Any]],
        redis_client: aioredis.Redis,
        key_prefix: str,
    ) -> None:
        http, feeds = dash
        await seed(
            redis_client,
            key_prefix,
            {
                "per-tenant|tenant=a|api_key=k1": 30,
                "per-tenant|tenant=b|api_key=k1": 90,
                "global": 5,
            },
        )
        at = datetime.now(UTC).isoformat()
        for tenant in ("a", "b"):
            feeds["refusals"].keep(
                json.dumps(
                    {
                        "request_id": f"r-{tenant}",
                        "subject": {"tenant": tenant, "api_key": "k1"},
                        "estimate": {"requests": 1},
                        "violated": ["per-tenant"],
                        "at": at,
                    }
                ).encode()
            )
            feeds["alerts"].keep(
                json.dumps(
                    {
                        "alert_id": f"al-{tenant}",
                        "kind": "exhausted",
                        "policy": "per-tenant",
                        "key": f"per-tenant|tenant={tenant}|api_key=k1",
                        "used": 100,
                        "limit": 100,
                        "at": at,
                    }
                ).encode()
            )
        await sign_in(http, "tok-a")
        rows = (await http.get("/api/budgets")).json()["rows"]
        assert [r["key"] for r in rows] == ["per-tenant|tenant=a|api_key=k1"]
        assert (await http.get("/api/budgets", params={"tenant": "b"})).status_code == 403
        detail = await http.get("/api/key", params={"key": "per-tenant|tenant=b|api_key=k1"})
        assert detail.status_code == 403
        live = (await http.get("/api/live")).json()
        assert [r["tenant"] for r in live["refusals"]] == ["a"]
        assert [a["key"] for a in live["alerts"]] == ["per-tenant|tenant=a|api_key=k1"]
        assert live["metrics"] is None  # admission's counters span every tenant
        assert "tenant=b" not in json.dumps(live) + json.dumps(rows)

        await sign_in(http, "tok-ops")
        rows = (await http.get("/api/budgets")).json()["rows"]
        assert [r["key"] for r in rows] == [
            "per-tenant|tenant=b|api_key=k1",
            "per-tenant|tenant=a|api_key=k1",
            "global",
        ]
        assert rows[0]["used"] == 90 and rows[0]["limit"] == 100 and rows[0]["share"] == 0.9
        live = (await http.get("/api/live")).json()
        assert len(live["refusals"]) == 2 and live["metrics"] is not None
        detail = await http.get("/api/key", params={"key": "per-tenant|tenant=b|api_key=k1"})
        body = detail.json()
        assert body["row"]["used"] == 90 and len(body["series"]["buckets"]) == 60
        assert len(body["refusals"]) == 1 and body["alerts"][0]["kind"] == "exhausted"

    async def test_bad_query_parameters_are_400_naming_the_field(
        self, dash: tuple[httpx.AsyncClient, dict[str, Any]]
    ) -> None:
        http, _ = dash
        await sign_in(http, "tok-ops")
        for params, field in (
            ({"sort": "nope"}, "sort"),
            ({"order": "up"}, "order"),
            ({"limit": "0"}, "limit"),
            ({"offset": "-1"}, "offset"),
            ({"colour": "red"}, "colour"),
        ):
            answer = await http.get("/api/budgets", params=params)
            assert answer.status_code == 400, params
            assert answer.json()["error"]["field"] == field


class TestIndex:
    async def test_top_n_paging_and_filters_over_many_keys(
        self,
        dash: tuple[httpx.AsyncClient, dict[str, Any]],
        redis_client: aioredis.Redis,
        key_prefix: str,
    ) -> None:
        http, _ = dash
        used = {f"per-tenant|tenant=t{i % 7}|api_key=k{i}": i % 100 for i in range(2000)}
        await seed(redis_client, key_prefix, used)
        await sign_in(http, "tok-ops")
        expected = sorted(used, key=lambda k: (-used[k], k))
        page = (await http.get("/api/budgets", params={"limit": 20})).json()
        assert page["matched"] == 2000
        assert [r["used"] for r in page["rows"]] == [used[k] for k in expected[:20]]
        second = (await http.get("/api/budgets", params={"limit": 20, "offset": 20})).json()
        assert [r["used"] for r in second["rows"]] == [used[k] for k in expected[20:40]]
        only = (await http.get("/api/budgets", params={"tenant": "t3", "limit": 5})).json()
        want = [k for k in expected if "tenant=t3|" in k]
        assert only["matched"] == len(want)
        assert [r["used"] for r in only["rows"]] == [used[k] for k in want[:5]]
        assert all(r["tenant"] == "t3" for r in only["rows"])
        by_key = (await http.get("/api/budgets", params={"sort": "key", "order": "asc"})).json()
        assert [r["key"] for r in by_key["rows"]] == sorted(used)[:50]

    async def test_an_expired_window_leaves_the_index_when_met(
        self,
        dash: tuple[httpx.AsyncClient, dict[str, Any]],
        redis_client: aioredis.Redis,
        key_prefix: str,
    ) -> None:
        http, _ = dash
        await seed(redis_client, key_prefix, {"per-tenant|tenant=a|api_key=x": 50, "global": 1})
        await redis_client.delete(window_key(key_prefix, "per-tenant|tenant=a|api_key=x"))
        await sign_in(http, "tok-ops")
        rows = (await http.get("/api/budgets")).json()["rows"]
        assert [r["key"] for r in rows] == ["global"]
        members = await redis_client.zrange(utilization_key(key_prefix), 0, -1)
        assert members == [window_key(key_prefix, "global").encode()]
        assert window_codec.decode(await redis_client.get(window_key(key_prefix, "global"))).buckets

    async def test_a_deleted_policys_keys_leave_the_index_when_met(
        self,
        dash: tuple[httpx.AsyncClient, dict[str, Any]],
        redis_client: aioredis.Redis,
        key_prefix: str,
    ) -> None:
        http, _ = dash
        await seed(redis_client, key_prefix, {"per-tenant|tenant=a|api_key=x": 50, "global": 1})
        await RedisMaterializer(redis_client, key_prefix).write_policies([GLOBAL])
        await sign_in(http, "tok-ops")
        rows = (await http.get("/api/budgets")).json()["rows"]
        assert [r["key"] for r in rows] == ["global"]
        members = await redis_client.zrange(utilization_key(key_prefix), 0, -1)
        assert members == [window_key(key_prefix, "global").encode()]
