"""Admission decisions on a real Redis: atomicity, idempotency, cap, downgrade, observe."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

import pytest
from pydantic import ValidationError

from spendgate.schemas.decisions import AdmitRequest
from spendgate.schemas.key_ids import KeyIds
from spendgate.schemas.prices import ModelPrice, PriceCatalog
from spendgate.schemas.redis_keys import request_key
from tests.fixtures.admission import MakeAdmission, RecordingPublisher
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.key_ids import TEST_SECRET, key_id

pytestmark = pytest.mark.integration


def _bucket_now(bucket_ms: int) -> int:
    now = int(time.time() * 1000)
    return now - now % bucket_ms


class TestAtomicity:
    async def test_200_concurrent_admits_never_reserve_more_than_the_limit(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(limit=1000, unit="input_tokens", window="1m", bucket="5s")
        await adm.policies(policy)
        key = f"{policy.id}|tenant=race"
        await adm.usage(key, {_bucket_now(5000): 130}, 5000)
        estimate = 7
        answers = await asyncio.gather(
            *(adm.admit("race", input_tokens=estimate) for _ in range(200))
        )
        statuses = [a.status_code for a in answers]
        assert set(statuses) == {200, 429}
        admitted = statuses.count(200)
        assert admitted == (1000 - 130) // estimate
        assert await adm.pending(key) == admitted * estimate <= 1000 - 130
        reserve_ids = {e.reservation_id for e in adm.publisher.events}  # type: ignore[attr-defined]
        assert len(reserve_ids) == admitted

    async def test_hierarchical_all_or_nothing(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        org = policy_factory(id="org", limit=10_000, unit="input_tokens", group_by=["tenant"])
        key_pol = policy_factory(
            id="per-key", limit=100, unit="input_tokens", group_by=["tenant", "api_key"]
        )
        await adm.policies(org, key_pol)
        subject = {"tenant": "acme", "api_key": "k1", "model": "m1"}
        ok = await adm.admit("acme", subject=dict(subject), input_tokens=80)
        assert ok.status_code == 200
        refused = await adm.admit("acme", subject=dict(subject), input_tokens=30)
        assert refused.status_code == 429
        assert refused.json()["violated"] == ["per-key"]
        assert await adm.pending("org|tenant=acme") == 80
        assert await adm.pending("per-key|tenant=acme|api_key=k1") == 80
        by_policy = {b["policy"]: b for b in refused.json()["budgets"]}
        assert by_policy["org"]["reserved"] == 80
        assert by_policy["per-key"]["remaining"] == 20

    async def test_repeats_of_a_request_id_return_the_same_reservation_and_change_nothing(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(limit=100, unit="input_tokens")
        await adm.policies(policy)
        rid = uuid.uuid4().hex
        first = await adm.admit("idem", rid, input_tokens=60)
        repeats = await asyncio.gather(*(adm.admit("idem", rid, input_tokens=60) for _ in range(5)))
        assert first.status_code == 200
        assert {r.json()["reservation_id"] for r in repeats} == {first.json()["reservation_id"]}
        assert all(r.json()["budgets"] == first.json()["budgets"] for r in repeats)
        assert await adm.pending(f"{policy.id}|tenant=idem") == 60
        assert adm.publisher.kinds() == ["reserve"]  # type: ignore[attr-defined]
        ttl_ms = await adm.redis.pttl(request_key(adm.prefix, "idem", rid))
        assert ttl_ms > policy.reservation_ttl_ms
        assert (await adm.admit("idem", input_tokens=60)).status_code == 429

    async def test_a_repeat_answers_amounts_beyond_fourteen_digits_exactly(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        # The stored answer is text: Lua writes a number past 14 significant digits as
        # "2.3706450097985e+15" unless each one is formatted as an integer (found by the
        # OpenAPI fuzz as a 500 on a repeated request id).
        adm = await make_admission()
        big = 2_370_645_009_798_517
        policy = policy_factory(limit=2**53 - 1, unit="input_tokens")
        await adm.policies(policy)
        rid = uuid.uuid4().hex
        first = await adm.admit("idem", rid, input_tokens=big)
        repeat = await adm.admit("idem", rid, input_tokens=big)
        assert first.status_code == repeat.status_code == 200, repeat.text
        assert repeat.json()["budgets"] == first.json()["budgets"]
        assert first.json()["budgets"][0]["reserved"] == big


class TestRejectAndHeaders:
    async def test_retry_after_is_exact_and_ratelimit_headers_name_the_tightest(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        tight = policy_factory(id="tight", limit=100, unit="input_tokens", window="1m", bucket="5s")
        loose = policy_factory(id="loose", limit=10_000, unit="input_tokens")
        await adm.policies(tight, loose)
        start = _bucket_now(5000)
        await adm.usage("tight|tenant=a", {start - 20_000: 60, start: 30}, 5000)
        answer = await adm.admit("a", input_tokens=20)
        assert answer.status_code == 429
        body = answer.json()
        # 60 ages out at (start - 20s) + 60s + 5s - 1ms ("include" boundary bucket).
        expected_ms = start - 20_000 + 60_000 + 5000 - 1 - int(time.time() * 1000)
        assert abs(body["retry_after_seconds"] - expected_ms / 1000) <= 1.1
        assert answer.headers["Retry-After"] == str(body["retry_after_seconds"])
        assert answer.headers["RateLimit-Policy"] == '"tight";q=100;w=60'
        assert answer.headers["RateLimit"].startswith('"tight";r=10;t=')
        reset = {b["policy"]: b["reset_after_seconds"] for b in body["budgets"]}
        # Everything counted in "tight" is gone one window + bucket after the newest bucket.
        assert abs(reset["tight"] - (start + 65_000 - time.time() * 1000) / 1000) <= 1.1
        assert reset["loose"] == 0
        never = await adm.admit("a", input_tokens=101)
        assert never.json()["never_fits"] is True and "Retry-After" not in never.headers

    async def test_a_pending_reservation_ages_out_with_its_bucket_not_its_ttl(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        # Issue 16, defect 1: the blocking reservation is still pending (no worker has
        # absorbed it), and Retry-After must still be bounded by window + bucket.
        adm = await make_admission()
        policy = policy_factory(limit=1000, unit="input_tokens", window="60s", bucket="1s")
        await adm.policies(policy)
        before = int(time.time() * 1000)
        assert (await adm.admit("pend", input_tokens=600)).status_code == 200
        after = int(time.time() * 1000)
        refused = await adm.admit("pend", input_tokens=600)
        assert refused.status_code == 429
        # The 600 sits in the 1 s bucket of its admission and ages out of the 60 s window
        # (include boundary) at bucket start + 61 s - 1 ms.
        earliest = before - before % 1000 + 61_000 - 1 - int(time.time() * 1000)
        latest = after - after % 1000 + 61_000 - 1 - before
        retry_s = int(refused.headers["Retry-After"])
        assert retry_s <= 61, f"Retry-After {retry_s} s exceeds window + bucket (61 s)"
        assert math.ceil(earliest / 1000) - 1 <= retry_s <= math.ceil(latest / 1000) + 1
        (budget,) = refused.json()["budgets"]
        assert budget["reserved"] == 600
        assert budget["reset_after_seconds"] <= 61

    async def test_retry_after_ages_absorbed_and_pending_amounts_alike(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(limit=1000, unit="input_tokens", window="60s", bucket="1s")
        await adm.policies(policy)
        key = f"{policy.id}|tenant=mix"
        old = _bucket_now(1000) - 30_000
        await adm.usage(key, {old: 300}, 1000)
        admitted_at = int(time.time() * 1000)
        assert (await adm.admit("mix", input_tokens=600)).status_code == 200
        # 300 + 600 + 200 > 1000: fits once the absorbed 300 ages out, ~31 s from now.
        small = await adm.admit("mix", input_tokens=200)
        assert small.status_code == 429
        (budget,) = small.json()["budgets"]
        assert (budget["used"], budget["reserved"]) == (300, 600)
        now = int(time.time() * 1000)
        assert abs(small.json()["retry_after_seconds"] - (old + 61_000 - now) / 1000) <= 1.1
        # 600 + 500 > 1000: fits only once the pending 600 has aged out too, ~61 s away.
        large = await adm.admit("mix", input_tokens=500)
        assert large.status_code == 429
        expected_s = (admitted_at - admitted_at % 1000 + 61_000 - now) / 1000
        assert abs(large.json()["retry_after_seconds"] - expected_s) <= 1.1
        assert int(large.headers["Retry-After"]) <= 61

    async def test_budgets_query_reserves_nothing(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        p = policy_factory(limit=500, unit="input_tokens", group_by=["tenant", "api_key"])
        other = policy_factory(limit=5, unit="requests", match={"tenant": "zzz"})
        await adm.policies(p, other)
        await adm.admit("acme", subject={"tenant": "acme", "api_key": "k"}, input_tokens=50)
        got = await adm.http.get("/v1/budgets", params={"tenant": "acme", "api_key": "k"})
        assert got.status_code == 200
        (budget,) = got.json()["budgets"]
        assert budget["key"] == f"{p.id}|tenant=acme|api_key=k"
        assert (budget["used"], budget["reserved"], budget["remaining"]) == (0, 50, 450)
        again = await adm.http.get("/v1/budgets", params={"tenant": "acme", "api_key": "k"})
        # The forecast and the reset move with the clock (the reset counts down, in whole
        # seconds: a second boundary may fall between the two reads); the rest is as it was.
        (later,) = again.json()["budgets"]
        later.pop("exhausts_in_seconds")
        budget.pop("exhausts_in_seconds")
        reset, reset_later = budget.pop("reset_after_seconds"), later.pop("reset_after_seconds")
        assert reset - 1 <= reset_later <= reset
        assert later == budget
        missing = await adm.http.get("/v1/budgets", params={"tenant": "acme"})
        assert missing.status_code == 400 and missing.json()["error"]["field"] == "subject.api_key"
        bad = await adm.http.get("/v1/budgets", params={"tenant": "acme", "nope": "1"})
        assert bad.status_code == 400

    async def test_budgets_carry_the_burn_rate_forecast(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        busy = policy_factory(limit=1000, unit="input_tokens", window="10m", bucket="10s")
        idle = policy_factory(limit=1000, unit="requests", window="10m", bucket="10s")
        await adm.policies(busy, idle)
        head = _bucket_now(10_000)
        # 100 in each of the last 6 buckets (the last 10% of the window): 600 used, about
        # 11 per second lately; the 400 left last ~36 s at that rate, and none of it ages
        # out meanwhile.
        await adm.usage(
            f"{busy.id}|tenant=acme", {head - k * 10_000: 100 for k in range(6)}, 10_000
        )
        await adm.usage(f"{idle.id}|tenant=acme", {head - 300_000: 5}, 10_000)
        got = await adm.http.get("/v1/budgets", params={"tenant": "acme"})
        assert got.status_code == 200, got.text
        by_policy = {b["policy"]: b for b in got.json()["budgets"]}
        elapsed_ms = 50_000 + int(time.time() * 1000) % 10_000
        expected_s = 400 * elapsed_ms / 600 / 1000
        assert abs(by_policy[busy.id]["exhausts_in_seconds"] - expected_s) <= 2
        assert by_policy[idle.id]["exhausts_in_seconds"] is None


class TestCap:
    async def test_total_tokens_cap_returns_what_remains_for_output(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        p = policy_factory(limit=1000, unit="total_tokens", on_exceed="cap")
        await adm.policies(p)
        await adm.usage(f"{p.id}|tenant=c", {_bucket_now(5000): 700}, 5000)
        answer = await adm.admit("c", input_tokens=100, output_tokens=500)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["decision"] == "cap"
        assert body["max_output_tokens"] == 200  # 1000 - 700 - 100 input
        assert body["budgets"][0]["remaining"] == 0
        assert await adm.pending(f"{p.id}|tenant=c") == 300
        (event,) = adm.publisher.events  # type: ignore[attr-defined]
        assert event.usage.output_tokens == 200
        # Nothing left for output: refused, not capped to zero.
        assert (await adm.admit("c", input_tokens=1, output_tokens=5)).status_code == 429

    async def test_cost_cap_goes_through_the_output_price(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        prices = PriceCatalog(
            list_prices={
                "m1": ModelPrice(input_per_mtok_micros=1_000_000, output_per_mtok_micros=3_000_000)
            }
        )
        adm = await make_admission(prices=prices)
        p = policy_factory(limit=1000, unit="cost_usd", on_exceed="cap")
        await adm.policies(p)
        # 100 input tokens cost 100 micros; 1000 output tokens would cost 3000.
        answer = await adm.admit("c", input_tokens=100, output_tokens=1000)
        body = answer.json()
        assert body["decision"] == "cap"
        assert body["max_output_tokens"] == 300  # 100 + 300*3 = 1000 micros
        assert body["budgets"][0]["reserved"] == 1000

    async def test_requests_unit_cannot_be_capped(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        p = policy_factory(limit=1, unit="requests", on_exceed="cap")
        await adm.policies(p)
        assert (await adm.admit("r", requests=1, output_tokens=10)).status_code == 200
        refused = await adm.admit("r", requests=1, output_tokens=10)
        assert refused.status_code == 429 and refused.json()["decision"] == "reject"


class TestDowngrade:
    async def test_downgrade_rechecks_the_target_model_and_reports_it(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        prices = PriceCatalog(
            list_prices={
                "big": ModelPrice(input_per_mtok_micros=10_000_000, output_per_mtok_micros=0),
                "small": ModelPrice(input_per_mtok_micros=1_000_000, output_per_mtok_micros=0),
            }
        )
        adm = await make_admission(prices=prices)
        big = policy_factory(
            id="big-cost",
            unit="cost_usd",
            limit=1500,
            match={"model": "big"},
            on_exceed="downgrade",
            downgrade_to="small",
        )
        small = policy_factory(
            id="small-cost", unit="cost_usd", limit=250, match={"model": "small"}
        )
        await adm.policies(big, small)
        subject = {"tenant": "d", "model": "big"}
        first = await adm.admit("d", subject=dict(subject), input_tokens=100)
        assert first.json()["decision"] == "allow" and first.json()["model"] == "big"
        down = await adm.admit("d", subject=dict(subject), input_tokens=100)
        assert down.status_code == 200, down.text
        body = down.json()
        assert body["decision"] == "downgrade"
        assert body["model"] == "small"
        assert down.headers["Spendgate-Model"] == "small"
        assert [b["policy"] for b in body["budgets"]] == ["small-cost"]
        assert body["budgets"][0]["reserved"] == 100  # at the small model's price
        assert await adm.pending("big-cost|tenant=d") == 1000
        events = adm.publisher.events  # type: ignore[attr-defined]
        assert events[-1].subject.model == "small"
        # The target's own policy then refuses: nothing downgrades twice.
        await adm.admit("d", subject=dict(subject), input_tokens=100)
        refused = await adm.admit("d", subject=dict(subject), input_tokens=100)
        assert refused.status_code == 429
        assert refused.json()["violated"] == ["big-cost"]
        assert await adm.pending("small-cost|tenant=d") == 200


class TestObserve:
    async def test_observe_never_refuses_and_says_what_would_have_happened(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        p = policy_factory(limit=100, unit="input_tokens", mode="observe")
        await adm.policies(p)
        for _ in range(3):
            answer = await adm.admit("o", input_tokens=60)
            assert answer.status_code == 200
        body = answer.json()
        assert body["decision"] == "observe_reject"
        assert body["violated"] == [p.id]
        assert body["retry_after_seconds"] >= 1
        assert await adm.pending(f"{p.id}|tenant=o") == 180  # charged all the same


class TestSettle:
    async def test_commit_release_once_and_conflicts(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(limit=1000, unit="input_tokens"))
        rid = (await adm.admit("s", input_tokens=10)).json()["reservation_id"]
        body = {"reservation_id": rid, "usage": {"input_tokens": 5}}
        assert (await adm.http.post("/v1/commit", json=body)).status_code == 202
        assert (await adm.http.post("/v1/commit", json=body)).status_code == 202  # retry
        conflict = await adm.http.post("/v1/release", json={"reservation_id": rid})
        assert conflict.status_code == 409
        publisher = adm.publisher
        assert isinstance(publisher, RecordingPublisher)
        assert publisher.kinds() == ["reserve", "commit", "commit"]
        assert len({e.event_id for e in publisher.events}) == 2  # the repeat is a duplicate


class TestBadInput:
    @pytest.mark.parametrize(
        ("content", "headers", "status", "code"),
        [
            (b"{not json", {"content-type": "application/json"}, 400, "invalid_json"),
            (b"{}", {"content-type": "text/plain"}, 415, "unsupported_media_type"),
            (b"x" * 70_000, {"content-type": "application/json"}, 413, "payload_too_large"),
            (b"[]", {"content-type": "application/json"}, 400, "invalid_request"),
            (
                b'{"request_id": "r", "subject": {}, "estimate": {"input_tokens": -1}}',
                {"content-type": "application/json"},
                400,
                "invalid_request",
            ),
        ],
    )
    async def test_bad_bodies_are_4xx_json_errors(
        self,
        make_admission: MakeAdmission,
        content: bytes,
        headers: dict[str, str],
        status: int,
        code: str,
    ) -> None:
        adm = await make_admission()
        answer = await adm.http.post("/v1/admit", content=content, headers=headers)
        assert answer.status_code == status
        assert answer.json()["error"]["code"] == code

    async def test_a_body_the_fast_path_hands_on_is_decided_alike_by_the_route(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        # A UTF-8 byte order mark: Python's JSON reading (the framework's) skips it,
        # pydantic's does not, so the fast path hands the body on to the FastAPI route.
        adm = await make_admission()
        policy = policy_factory(limit=100, unit="input_tokens")
        await adm.policies(policy)
        body = json.dumps(
            {
                "request_id": uuid.uuid4().hex,
                "subject": {"tenant": "bom", "model": "m1"},
                "estimate": {"input_tokens": 60},
            }
        ).encode()
        marked = b"\xef\xbb\xbf" + body
        with pytest.raises(ValidationError):
            AdmitRequest.model_validate_json(marked)
        headers = {"content-type": "application/json"}
        fast = await adm.http.post("/v1/admit", content=body, headers=headers)
        routed = await adm.http.post("/v1/admit", content=marked, headers=headers)
        assert fast.status_code == routed.status_code == 200
        # The same request id: the route answers the first decision, byte for byte.
        assert routed.content == fast.content
        assert routed.headers["content-type"] == fast.headers["content-type"]
        assert await adm.pending(f"{policy.id}|tenant=bom") == 60  # reserved once

    async def test_unknown_route_and_method_are_json_errors(
        self, make_admission: MakeAdmission
    ) -> None:
        adm = await make_admission()
        assert (await adm.http.get("/nope")).json()["error"]["code"] == "not_found"
        wrong = await adm.http.get("/v1/admit")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"

    async def test_unpriced_model_is_422_naming_it(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(unit="cost_usd"))
        answer = await adm.admit("u", input_tokens=1)
        assert answer.status_code == 422
        assert "m1" in answer.json()["error"]["message"]

    async def test_metrics_are_exported(self, make_admission: MakeAdmission) -> None:
        adm = await make_admission()
        await adm.admit("m", input_tokens=1)
        text = (await adm.http.get("/metrics")).text
        for name in (
            "spendgate_admission_decisions_total",
            "spendgate_admission_seconds_bucket",
            "spendgate_admission_publish_buffer_events",
            "spendgate_admission_store_failures_total",
        ):
            assert name in text


class TestHeaders:
    async def test_a_model_outside_latin_1_is_percent_encoded_in_the_header(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        # Found by the schemathesis fuzz once it varied per run: a 500 from the header.
        adm = await make_admission()
        await adm.policies(policy_factory(unit="input_tokens", limit=10_000))
        answer = await adm.admit("u", subject={"tenant": "u", "model": "坙-m1"}, input_tokens=5)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "坙-m1"
        assert answer.headers["Spendgate-Model"] == "%E5%9D%99-m1"


class TestKeyIds:
    """Admission decides, stores and publishes a secret subject field only as its key id."""

    async def test_a_raw_api_key_is_decided_and_published_as_its_key_id(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(key_ids=KeyIds(TEST_SECRET.encode()))
        policy = policy_factory(limit=10, unit="requests", group_by=["tenant", "api_key"])
        await adm.policies(policy)
        subject = {"tenant": "acme", "api_key": "sk-live-raw-9", "model": "m1"}
        ok = await adm.admit("acme", subject=subject, requests=4)
        assert ok.status_code == 200, ok.text
        key = f"{policy.id}|tenant=acme|api_key={key_id('sk-live-raw-9')}"
        assert [b["key"] for b in ok.json()["budgets"]] == [key]
        assert await adm.pending(key) == 4
        (event,) = adm.publisher.events  # type: ignore[attr-defined]
        assert event.subject.api_key == key_id("sk-live-raw-9")
        # The client library's key id is the same budget: 4 + 7 > 10.
        again = dict(subject, api_key=key_id("sk-live-raw-9"))
        refused = await adm.admit("acme", subject=again, requests=7)
        assert refused.status_code == 429, refused.text
        listed = await adm.http.get(
            "/v1/budgets", params={"tenant": "acme", "api_key": "sk-live-raw-9"}
        )
        assert [b["key"] for b in listed.json()["budgets"]] == [key]
        assert "sk-live-raw-9" not in ok.text + refused.text + listed.text

    async def test_a_key_id_of_another_secret_is_refused_naming_the_field(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission(key_ids=KeyIds(TEST_SECRET.encode()))
        await adm.policies(policy_factory(limit=10, unit="requests"))
        other = key_id("sk-live-raw-9", secret=b"another deployment's secret")
        subject = {"tenant": "acme", "api_key": other, "model": "m1"}
        answer = await adm.admit("acme", subject=subject, requests=1)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["field"] == "subject.api_key"
        assert "another subject secret" in error["message"]
        assert not adm.publisher.events  # type: ignore[attr-defined]
