"""The dashboard's numbers from windows and metrics, checked against hand-computed values."""

from __future__ import annotations

from typing import Any

import pytest

from spendgate.admission.auth import OPERATOR, Authorizer, Principal
from spendgate.dashboard.app import Sessions
from spendgate.dashboard.views import key_row, parse_scrape, rates, window_series
from spendgate.schemas import window_codec
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.policies import Policy
from spendgate.schemas.shards import tenant_of

#: A broker nobody listens on: the feeds only ever fail to connect.
NOWHERE = KafkaConnection(bootstrap="127.0.0.1:1")

MIN = 60_000


def policy(**fields: Any) -> Policy:
    base = {"id": "p", "unit": "requests", "limit": 10, "window": "1m", "bucket": "10s"}
    return Policy.model_validate({**base, **fields})


class TestTenantOf:
    def test_group_by_value_then_exact_match_then_none(self) -> None:
        assert tenant_of(policy(group_by=["tenant"]), {"tenant": "acme"}) == "acme"
        assert tenant_of(policy(match={"tenant": "acme"}, group_by=["api_key"]), {}) == "acme"
        assert tenant_of(policy(match={"tenant": "ac*"}, group_by=["api_key"]), {}) is None
        assert tenant_of(policy(), {}) is None


class TestKeyRow:
    def test_used_reserved_and_retry_after_of_a_full_window(self) -> None:
        p = policy(group_by=["tenant"])
        now = 10 * MIN + 5_000  # 5 s into the bucket at 10 min
        # 4 absorbed in the oldest full bucket (ages out 55 s from now), 5 in the head;
        # 1 pending (admission's reservation) in the head bucket.
        window = window_codec.encode({10 * MIN - 50_000: 4, 10 * MIN: 5}, 10_000)
        pending = {str(10 * MIN + 9_999).encode(): b"1"}
        row = key_row("p|tenant=acme", p, window, pending, now)
        assert (row.used, row.reserved, row.limit) == (9, 1, 10)
        assert row.tenant == "acme" and row.policy == "p" and row.window_seconds == 60
        assert row.share == pytest.approx(1.0)
        # Full: one more request fits when the 4 age out, at the end of their bucket +
        # window: (10 min - 50 s) + 10 s + 60 s = 10 min + 20 s, 15 s from now.
        assert row.retry_after_seconds == 15

    def test_room_left_means_no_wait(self) -> None:
        window = window_codec.encode({10 * MIN: 3}, 10_000)
        row = key_row("p", policy(), window, {}, 10 * MIN + 1)
        assert (row.used, row.reserved, row.retry_after_seconds) == (3, 0, 0)
        assert row.tenant is None

    def test_exhausts_in_shows_a_burst_heading_for_the_limit_and_nothing_for_an_old_one(
        self,
    ) -> None:
        now = 10 * MIN + 5_000
        burst = key_row(
            "p", policy(limit=100), window_codec.encode({10 * MIN: 50}, 10_000), {}, now
        )
        assert burst.exhausts_in_seconds is not None and 0 < burst.exhausts_in_seconds <= 60
        old = window_codec.encode({10 * MIN - 50_000: 50}, 10_000)  # ages out, nothing new
        assert key_row("p", policy(limit=100), old, {}, now).exhausts_in_seconds is None

    def test_series_covers_the_window_bucket_by_bucket(self) -> None:
        window = window_codec.encode({10 * MIN - 20_000: 2, 10 * MIN: 3}, 10_000)
        s = window_series(policy(), window, {str(10 * MIN + 9_999): "1"}, 10 * MIN + 5_000)
        starts = [b["start_ms"] for b in s["buckets"]]
        assert starts == [10 * MIN - 50_000 + 10_000 * i for i in range(6)]
        assert s["buckets"][3]["absorbed"] == 2 and s["buckets"][5]["absorbed"] == 3
        assert s["buckets"][5]["pending"] == 1
        assert s["buckets"][-1]["total"] == 6 and s["limit"] == 10


ADMISSION = """\
# HELP spendgate_admission_decisions_total Admission answers by decision.
# TYPE spendgate_admission_decisions_total counter
spendgate_admission_decisions_total{decision="allow"} 100.0
spendgate_admission_decisions_total{decision="reject"} 7.0
"""
ADMISSION_LATER = ADMISSION.replace("} 100.0", "} 130.0").replace("} 7.0", "} 11.0")
WORKER = """\
# TYPE spendgate_dead_lettered_total counter
spendgate_dead_lettered_total 2.0
# TYPE spendgate_processing_lag_seconds histogram
spendgate_processing_lag_seconds_bucket{le="+Inf"} 10.0
spendgate_processing_lag_seconds_count 10.0
spendgate_processing_lag_seconds_sum 1.0
"""
WORKER_LATER = WORKER.replace("_count 10.0", "_count 20.0").replace("_sum 1.0", "_sum 4.0")


class TestMetrics:
    def test_rates_between_two_scrapes(self) -> None:
        first = parse_scrape(100.0, ADMISSION, WORKER)
        second = parse_scrape(102.0, ADMISSION_LATER, WORKER_LATER)
        panel = rates(first, second)
        assert panel["refusals_per_s"] == pytest.approx(2.0)  # 4 more rejects in 2 s
        assert panel["decisions"]["allow"] == {"total": 130.0, "per_s": pytest.approx(15.0)}
        assert panel["refused_total"] == 11.0
        assert panel["worker_lag_s"] == pytest.approx(0.3)  # 3 s over 10 records
        assert panel["dead_letters"] == 2.0

    def test_a_first_or_missing_scrape_has_no_rates(self) -> None:
        panel = rates(None, parse_scrape(1.0, None, None))
        assert panel["refusals_per_s"] is None and panel["decisions"] == {}
        assert panel["worker_lag_s"] is None and panel["dead_letters"] is None


class MemorySignOuts:
    """Sign-outs in a dict, as Redis keeps them for every replica (``RedisSignOuts``)."""

    def __init__(self) -> None:
        self.until: dict[str, int] = {}

    async def sign_out(self, sid: str, until_s: int) -> None:
        self.until[sid] = until_s

    async def signed_out(self, sid: str) -> bool:
        return sid in self.until


SESSION_SECRET = b"a-session-secret-of-32-bytes-ok!"
GRANTS: dict[str, Any] = {"tok-a": frozenset({"a"}), "tok-ops": OPERATOR}


class TestSessions:
    @staticmethod
    def sessions(
        now: list[float],
        sign_outs: MemorySignOuts,
        secret: bytes = SESSION_SECRET,
        grants: dict[str, Any] = GRANTS,
    ) -> Sessions:
        return Sessions(secret, 10, Authorizer(grants), sign_outs, clock=lambda: now[0])

    async def test_a_cookie_is_taken_by_any_process_holding_the_secret(self) -> None:
        now, outs = [1_000.0], MemorySignOuts()
        cookie = self.sessions(now, outs).open("tok-a")
        assert "tok-a" not in cookie and cookie.startswith("v1.")
        # Another instance (a restarted dashboard, another replica) with the same secret.
        assert await self.sessions(now, outs).get(cookie) == Principal(frozenset({"a"}))
        ops = self.sessions(now, outs).open("tok-ops")
        assert await self.sessions(now, outs).get(ops) == Principal(None, operator=True)
        assert (
            await self.sessions(now, outs, secret=b"another-secret-32-bytes-long-xx!").get(cookie)
            is None
        )

    async def test_a_tampered_or_forged_cookie_is_refused(self) -> None:
        import base64
        import json

        now, outs = [1_000.0], MemorySignOuts()
        sessions = self.sessions(now, outs)
        cookie = sessions.open("tok-a")
        version, payload, signature = cookie.split(".")
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        ops_tid = json.loads(
            base64.urlsafe_b64decode(
                (p := sessions.open("tok-ops").split(".")[1]) + "=" * (-len(p) % 4)
            )
        )["tid"]
        for changed in ({**claims, "exp": claims["exp"] + 3600}, {**claims, "tid": ops_tid}):
            raw = base64.urlsafe_b64encode(json.dumps(changed).encode()).rstrip(b"=").decode()
            assert await sessions.get(f"{version}.{raw}.{signature}") is None
        flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
        for bad in (f"{version}.{payload}.{flipped}", f"v2.{payload}.{signature}", "forged", "",
                    None, f"{version}.{payload}", f"{version}..{signature}"):  # fmt: skip
            assert await sessions.get(bad) is None, bad
        assert await sessions.get(cookie) == Principal(frozenset({"a"}))

    async def test_a_session_ends_at_its_ttl(self) -> None:
        now, outs = [1_000.0], MemorySignOuts()
        sessions = self.sessions(now, outs)
        cookie = sessions.open("tok-a")
        now[0] = 1_009.0
        assert await sessions.get(cookie) is not None
        now[0] = 1_010.0
        assert await sessions.get(cookie) is None

    async def test_a_signed_out_cookie_is_refused_everywhere_until_it_would_expire(self) -> None:
        now, outs = [1_000.0], MemorySignOuts()
        one, other = self.sessions(now, outs), self.sessions(now, outs)
        cookie, kept = one.open("tok-a"), one.open("tok-a")
        await other.close(cookie)
        assert await one.get(cookie) is None and await other.get(cookie) is None
        # The record lives as long as the cookie could: the expiry it carries.
        assert list(outs.until.values()) == [1_010]
        # Only that session: another browser of the same token stays signed in.
        assert await one.get(kept) == Principal(frozenset({"a"}))
        await other.close("forged")
        assert len(outs.until) == 1

    async def test_a_token_taken_out_of_the_tokens_file_ends_its_sessions(self) -> None:
        now, outs = [1_000.0], MemorySignOuts()
        cookie = self.sessions(now, outs).open("tok-a")
        assert await self.sessions(now, outs, grants={"tok-ops": OPERATOR}).get(cookie) is None

    def test_a_short_secret_is_refused(self) -> None:
        with pytest.raises(ValueError, match="at least 16 bytes"):
            self.sessions([0.0], MemorySignOuts(), secret=b"short")


class TestStoreDown:
    async def test_an_unreachable_redis_is_a_503_json_error(self) -> None:
        import httpx
        import redis.asyncio as aioredis

        from spendgate.admission.auth import Authorizer
        from spendgate.dashboard.app import create_app
        from spendgate.dashboard.feeds import Scraper, TopicFeed
        from spendgate.dashboard.reader import BudgetReader
        from spendgate.schemas.alerts import Alert
        from spendgate.schemas.refusals import Refusal

        client = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
        app = create_app(
            BudgetReader(client, "x:"),
            Authorizer(None),
            TopicFeed(NOWHERE, "t", Alert, 5),
            TopicFeed(NOWHERE, "t", Refusal, 5),
            Scraper("http://127.0.0.1:1/", "http://127.0.0.1:1/", 1.0),
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://d") as http:
            answer = await http.get("/api/budgets")
        await client.aclose()
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "store_unavailable"


class TestTopicFeed:
    @staticmethod
    def refusal(request_id: str, tenant: str = "a") -> bytes:
        import json

        return json.dumps(
            {
                "request_id": request_id,
                "subject": {"tenant": tenant},
                "estimate": {"requests": 1},
                "violated": ["p"],
                "at": "2026-11-30T12:00:00Z",
            }
        ).encode()

    def test_keeps_the_latest_and_counts_a_retried_refusal_once(self) -> None:
        from spendgate.dashboard.feeds import TopicFeed
        from spendgate.schemas.refusals import Refusal

        feed = TopicFeed(
            NOWHERE, "t", Refusal, 3, identity=lambda r: f"{r.subject.tenant}|{r.request_id}"
        )
        for rid in ("r1", "r1", "r2", "r3", "r2", "r4"):
            feed.keep(self.refusal(rid))
        feed.keep(self.refusal("r4", tenant="b"))  # another tenant's request id
        feed.keep(b"not json")
        assert [(r.subject.tenant, r.request_id) for r in feed.items] == [
            ("a", "r3"),
            ("a", "r4"),
            ("b", "r4"),
        ]
        feed.keep(self.refusal("r1"))  # r1 left the window of 3: kept again
        assert feed.items[-1].request_id == "r1"
