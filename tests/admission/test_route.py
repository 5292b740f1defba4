"""``on_exceed: route`` on a real Redis: the routed subject's budgets re-checked in the same
script, alternatives tried in order."""

from __future__ import annotations

import pytest

from tests.fixtures.admission import MakeAdmission
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration


def _subject(pool: str) -> dict[str, str]:
    return {"tenant": "acme", "model": "m1", "pool": pool}


class TestRoute:
    async def test_a_route_is_rechecked_against_the_routed_pools_budget(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        east = policy_factory(
            id="east",
            unit="input_tokens",
            limit=50,
            match={"pool": "gpu-east"},
            group_by=["pool"],
            on_exceed="route",
            route_to="gpu-west",
        )
        west = policy_factory(
            id="west", unit="input_tokens", limit=30, match={"pool": "gpu-west"}, group_by=[]
        )
        await adm.policies(east, west)
        first = await adm.admit("acme", subject=_subject("gpu-east"), input_tokens=40)
        assert first.json()["decision"] == "allow"
        routed = await adm.admit("acme", subject=_subject("gpu-east"), input_tokens=20)
        body = routed.json()
        assert routed.status_code == 200
        assert body["decision"] == "route"
        assert body["route_to"] == "gpu-west"
        assert routed.headers["Spendgate-Route"] == "gpu-west"
        assert routed.headers["Spendgate-Decision"] == "route"
        assert [b["policy"] for b in body["budgets"]] == ["west"]
        # Held on the routed pool's budget only.
        assert await adm.pending("east|pool=gpu-east") == 40
        assert await adm.pending("west") == 20
        reserve = adm.publisher.events[-1]  # type: ignore[attr-defined]
        assert reserve.reservation_id == body["reservation_id"]
        assert reserve.subject.pool == "gpu-west"
        # The routed pool is full too: refused, nothing held anywhere.
        refused = await adm.admit("acme", subject=_subject("gpu-east"), input_tokens=20)
        assert refused.status_code == 429
        assert refused.json()["decision"] == "reject"
        assert refused.json()["violated"] == ["east"]
        assert refused.json()["retry_after_seconds"] >= 1
        assert await adm.pending("east|pool=gpu-east") == 40
        assert await adm.pending("west") == 20
        # A request sent to the routed pool itself is not routed again.
        direct = await adm.admit("acme", subject=_subject("gpu-west"), input_tokens=20)
        assert direct.status_code == 429

    async def test_alternatives_are_tried_in_order_until_one_fits(
        self, make_admission: MakeAdmission, policy_factory: PolicyFactory
    ) -> None:
        adm = await make_admission()
        common = {"unit": "requests", "group_by": ["pool"], "on_exceed": "route"}
        a = policy_factory(id="a-first", limit=1, route_to="west", **common)
        b = policy_factory(id="b-second", limit=1, route_to="central", **common)
        west_full = policy_factory(
            id="c-west", unit="requests", limit=1, match={"pool": "west"}, group_by=[]
        )
        await adm.policies(a, b, west_full)
        # Fill east, and west (its own policies and a-first/b-second under pool=west).
        assert (await adm.admit("acme", subject=_subject("east"), requests=1)).status_code == 200
        assert (await adm.admit("acme", subject=_subject("west"), requests=1)).status_code == 200
        answer = await adm.admit("acme", subject=_subject("east"), requests=1)
        assert answer.json()["decision"] == "route"
        assert answer.json()["route_to"] == "central"
        assert await adm.pending("a-first|pool=central") == 1
        assert await adm.pending("a-first|pool=west") == 1
