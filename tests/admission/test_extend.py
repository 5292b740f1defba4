"""``POST /v1/extend`` (every budget or none, once per sequence number) and ``cap_next``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from spendgate.admission.auth import Authorizer, Grant
from spendgate.schemas.events import ExtendEvent
from spendgate.schemas.overage import OverageMark
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import overage_key, pending_reservations_key
from tests.fixtures.admission import Admission, MakeAdmission
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration


async def _admitted(adm: Admission, tokens: int) -> str:
    answer = await adm.admit("acme", output_tokens=tokens)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["reservation_id"])


async def _extend(adm: Admission, rid: str, seq: int, **add: Any) -> httpx.Response:
    body = {"reservation_id": rid, "seq": seq, "add": add}
    return await adm.http.post("/v1/extend", json=body)


def _key(policy: Policy) -> str:
    return f"{policy.id}|tenant=acme"


class TestExtend:
    async def test_an_extend_grows_every_budget_and_publishes_its_event(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        small, big = policy_factory(limit=100), policy_factory(limit=1000)
        await adm.policies(small, big)
        rid = await _admitted(adm, 30)
        answer = await _extend(adm, rid, 1, output_tokens=20)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["decision"], body["seq"], body["violated"]) == ("allow", 1, [])
        assert {b["policy"]: b["remaining"] for b in body["budgets"]} == {
            small.id: 50,
            big.id: 950,
        }
        assert await adm.pending(_key(small)) == 50
        assert await adm.pending(_key(big)) == 50
        event = adm.publisher.events[-1]  # type: ignore[attr-defined]
        assert isinstance(event, ExtendEvent)
        assert (event.event_id, event.seq, event.usage.output_tokens) == (
            f"extend-1-{rid}",
            1,
            20,
        )
        # Its own pending entry, for the worker to absorb when it applies the event.
        entry = await adm.redis.hget(
            pending_reservations_key(adm.prefix, _key(small)), event.event_id
        )
        assert entry is not None and entry.endswith(b":20")

    async def test_all_or_nothing_across_budgets(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        small, big = policy_factory(limit=100), policy_factory(limit=1000)
        await adm.policies(small, big)
        rid = await _admitted(adm, 60)
        answer = await _extend(adm, rid, 1, output_tokens=50)
        assert answer.status_code == 429, answer.text
        body = answer.json()
        assert body["decision"] == "reject"
        assert body["violated"] == [small.id]
        assert {b["policy"]: b["remaining"] for b in body["budgets"]} == {
            small.id: 40,
            big.id: 940,
        }
        # Nothing grew anywhere, not even on the budget with room.
        assert await adm.pending(_key(small)) == 60
        assert await adm.pending(_key(big)) == 60
        assert adm.publisher.kinds() == ["reserve"]  # type: ignore[attr-defined]
        # What still fits is granted.
        assert (await _extend(adm, rid, 2, output_tokens=40)).status_code == 200
        assert await adm.pending(_key(small)) == 100

    async def test_a_retried_extend_is_applied_once(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(limit=1000)
        await adm.policies(policy)
        rid = await _admitted(adm, 10)
        answers = await asyncio.gather(*(_extend(adm, rid, 1, output_tokens=25) for _ in range(20)))
        assert {a.status_code for a in answers} == {200}
        assert len({a.text for a in answers}) == 1  # every repeat gets the first answer
        assert await adm.pending(_key(policy)) == 35
        # Each repeat republishes the same event (one id): the worker counts it once.
        ids = {e.event_id for e in adm.publisher.events if e.kind == "extend"}  # type: ignore[attr-defined]
        assert ids == {f"extend-1-{rid}"}
        assert (await _extend(adm, rid, 2, output_tokens=25)).status_code == 200
        assert await adm.pending(_key(policy)) == 60

    async def test_unknown_settled_and_foreign_reservations_are_refused(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(limit=1000))
        missing = await _extend(adm, "nope", 1, output_tokens=1)
        assert missing.status_code == 404
        assert missing.json()["error"]["field"] == "reservation_id"
        rid = await _admitted(adm, 10)
        commit = await adm.http.post(
            "/v1/commit", json={"reservation_id": rid, "usage": {"output_tokens": 5}}
        )
        assert commit.status_code == 202
        settled = await _extend(adm, rid, 1, output_tokens=1)
        assert settled.status_code == 409
        assert settled.json()["error"]["code"] == "already_settled"

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"reservation_id": "r", "seq": 0, "add": {}}, "seq"),
            ({"reservation_id": "r", "seq": 1, "add": {"output_tokens": -1}}, "add.output_tokens"),
            ({"reservation_id": "r", "add": {}}, "seq"),
            ({"reservation_id": "r", "seq": 1, "add": {}, "x": 1}, "x"),
        ],
    )
    async def test_bad_bodies_are_400_naming_the_field(
        self, make_admission: MakeAdmission, body: dict[str, Any], field: str
    ) -> None:
        adm = await make_admission()
        answer = await adm.http.post("/v1/extend", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["field"] == field

    async def test_an_extend_refused_by_an_unvouched_window_grows_nothing(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        policy = policy_factory(limit=1000)
        await adm.policies(policy)
        rid = await _admitted(adm, 10)
        await adm.marks(None)
        answer = await _extend(adm, rid, 1, output_tokens=5)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "state_unvouched"
        assert await adm.pending(_key(policy)) == 10


class TestCapNext:
    async def test_the_next_estimate_is_scaled_by_the_decaying_ratio(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        chronic = policy_factory(limit=10_000, window="1h", bucket="1m", overage="cap_next")
        await adm.policies(chronic)
        key = _key(chronic)
        # The worker saw a commit at 3x its reservation half a window ago: factor 2.
        now_ms = int(time.time() * 1000)
        mark = OverageMark(3000, now_ms - 1_800_000)
        await adm.redis.set(overage_key(adm.prefix, key), mark.encode())
        answer = await adm.admit("acme", output_tokens=100, requests=1)
        assert answer.status_code == 200, answer.text
        assert 199 <= await adm.pending(key) <= 201  # 100 x ~2 (the factor decays by the ms)
        reserve = adm.publisher.events[-1]  # type: ignore[attr-defined]
        assert reserve.kind == "reserve" and reserve.usage.requests == 1
        assert 199 <= reserve.usage.output_tokens <= 201

    async def test_record_policies_and_fresh_keys_are_not_scaled(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        recorded = policy_factory(limit=10_000, window="1h", bucket="1m")
        chronic = policy_factory(limit=10_000, window="1h", bucket="1m", overage="cap_next")
        await adm.policies(recorded, chronic)
        now_ms = int(time.time() * 1000)
        await adm.redis.set(overage_key(adm.prefix, _key(recorded)), f"5000:{now_ms}")
        assert (await adm.admit("acme", output_tokens=100)).status_code == 200
        assert await adm.pending(_key(recorded)) == 100  # record: only counted, not scaled
        assert await adm.pending(_key(chronic)) == 100  # cap_next, but no overage on it


class TestExtendScope:
    async def test_observe_budgets_never_refuse_an_extend_but_are_charged(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        watched = policy_factory(limit=50, mode="observe")
        await adm.policies(watched)
        rid = await _admitted(adm, 40)
        answer = await _extend(adm, rid, 1, output_tokens=100)
        assert answer.status_code == 200, answer.text
        assert answer.json()["violated"] == []
        assert await adm.pending(_key(watched)) == 140

    async def test_a_token_extends_only_its_own_tenants_reservations(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        tokens: dict[str, Grant] = {"tok-a": frozenset({"acme"}), "tok-b": frozenset({"b"})}
        adm = await make_admission(authorizer=Authorizer(tokens))
        await adm.policies(policy_factory(limit=1000))
        own = {"Authorization": "Bearer tok-a"}
        admitted = await adm.admit("acme", output_tokens=10, headers=own)
        rid = admitted.json()["reservation_id"]
        body = {"reservation_id": rid, "seq": 1, "add": {"output_tokens": 5}}
        other = await adm.http.post(
            "/v1/extend", json=body, headers={"Authorization": "Bearer tok-b"}
        )
        assert other.status_code == 403
        assert other.json()["error"]["field"] == "reservation_id"
        assert (await adm.http.post("/v1/extend", json=body)).status_code == 401
        assert (await adm.http.post("/v1/extend", json=body, headers=own)).status_code == 200
