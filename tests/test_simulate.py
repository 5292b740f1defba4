"""simulate's judge: all matching draft policies at once, all-or-nothing, cap, observe."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson

from spendgate.admission.decide import Planner
from spendgate.schemas.events import Subject, Usage
from spendgate.schemas.policies import Policy
from spendgate.simulation import ABSORB_LAG, Merged, Simulation, caveats, judge


def policy(pid: str, **fields: object) -> Policy:
    return Policy.model_validate({"id": pid, "unit": "output_tokens", "limit": 100, **fields})


def charges(*policies: Policy, output: int = 50) -> list:  # type: ignore[type-arg]
    return Planner(list(policies), None).charges(
        Subject(tenant="a", model="m"), Usage(requests=1, input_tokens=10, output_tokens=output)
    )


class TestJudge:
    def test_fits_everywhere_admits_with_the_asked_amounts(self) -> None:
        got = judge(charges(policy("a"), policy("b")), [10, 20], 50)
        assert not got.refused and got.amounts == (50, 50) and got.max_output_tokens is None

    def test_one_enforced_policy_over_refuses_the_whole_request(self) -> None:
        got = judge(charges(policy("a"), policy("b")), [10, 60], 50)
        assert got.refused and got.violated == ("b",)

    def test_observe_never_refuses(self) -> None:
        got = judge(charges(policy("a", mode="observe")), [90], 50)
        assert not got.refused

    def test_cap_admits_with_the_output_that_fits_every_key(self) -> None:
        got = judge(charges(policy("a", on_exceed="cap"), policy("b", limit=1000)), [70, 0], 50)
        assert not got.refused and got.max_output_tokens == 30 and got.amounts == (30, 30)

    def test_cap_cannot_help_a_unit_that_ignores_output(self) -> None:
        got = judge(charges(policy("a", on_exceed="cap", unit="requests", limit=1)), [1], 50)
        assert got.refused


class TestCaveats:
    def test_only_cap_next_is_left_out(self) -> None:
        drafts = [
            policy("b", burst={"rate": 5, "per": "1s", "capacity": 20}),
            policy("d", on_exceed="delay"),
            policy("r", on_exceed="route", route_to="west"),
            policy("n", overage="cap_next"),
        ]
        assert [c.split(":")[0] for c in caveats(drafts) if c != ABSORB_LAG] == ["n"]

    def test_the_absorb_lag_is_stated_for_any_draft(self) -> None:
        assert caveats([policy("a")]) == [ABSORB_LAG]
        assert caveats([]) == []


class TestActions:
    """delay and route drafts judged on a history fed straight to the simulation."""

    def _run(self, draft: list[Policy], events: list[tuple[int, dict]]) -> Simulation:  # type: ignore[type-arg]
        sim = Simulation(draft, None, 86_400_000)
        try:
            for n, (at, body) in enumerate(events):
                sim.feed(Merged(at, n, 0, at, orjson.dumps(body)))
            sim.finish()
        finally:
            sim.close()
        return sim

    @staticmethod
    def reserve(n: int, at: int, tokens: int, **subject: str) -> tuple[int, dict]:  # type: ignore[type-arg]
        iso = datetime.fromtimestamp(at / 1000, UTC).isoformat()
        return at, {
            "event_id": f"e{n}",
            "kind": "reserve",
            "subject": {"tenant": "a", "model": "m", **subject},
            "occurred_at": iso,
            "reservation_id": f"r{n}",
            "usage": {"output_tokens": tokens},
            "expires_at": datetime.fromtimestamp(at / 1000 + 600, UTC).isoformat(),
        }

    def test_delay_admits_what_fits_within_max_delay_and_refuses_the_rest(self) -> None:
        # 30 s window of 1 s buckets, limit 100; 90 at t0; the next 20 fit once it ages out.
        draft = [policy("d", window="30s", bucket="1s", on_exceed="delay", max_delay="5s")]
        t0 = 1_700_000_000_000
        sim = self._run(
            draft,
            [
                self.reserve(1, t0, 90),
                self.reserve(2, t0 + 27_000, 20),  # fits at t0 + 30 s: 3 s wait, admitted
                self.reserve(3, t0 + 31_000, 90),  # 20 held, 90 more never fits in 5 s
            ],
        )
        pr = sim.report.policies["d"]
        assert (pr.delayed, pr.refused) == (1, 1)
        state = sim.states["d"]
        assert t0 + 30_000 in state.buckets and state.buckets[t0 + 30_000] == 20

    def test_burst_refuses_beside_the_window_and_refills(self) -> None:
        # A bucket of 10 refilled 1 per second; the window (limit 100) never binds here.
        draft = [policy("b", burst={"rate": 1, "per": "1s", "capacity": 10})]
        t0 = 1_700_000_000_000
        sim = self._run(
            draft,
            [
                self.reserve(1, t0, 6),  # 10 -> 4
                self.reserve(2, t0 + 1_000, 6),  # 5 tokens: refused, takes nothing
                self.reserve(3, t0 + 5_000, 6),  # 9 tokens: admitted
            ],
        )
        pr = sim.report.policies["b"]
        assert (pr.requests, pr.refused) == (3, 1)
        assert pr.first_refusal == datetime.fromtimestamp((t0 + 1_000) / 1000, UTC)
        assert sum(sim.states["b"].buckets.values()) == 12

    def test_route_charges_the_routed_pool(self) -> None:
        draft = [
            policy("east", match={"pool": "east"}, group_by=["pool"], on_exceed="route",
                   route_to="west"),
            policy("west", match={"pool": "west"}, group_by=["pool"]),
        ]  # fmt: skip
        t0 = 1_700_000_000_000
        sim = self._run(
            draft,
            [self.reserve(1, t0, 80, pool="east"), self.reserve(2, t0 + 1, 50, pool="east")],
        )
        assert sim.report.policies["east"].replaced == 1
        assert sum(sim.states["west|pool=west"].buckets.values()) == 50
        assert sum(sim.states["east|pool=east"].buckets.values()) == 80
