"""Scenario 7: tenants are isolated, and no subject value can reach another budget key.

Auth: a token acts only for its tenants (admit, budgets, commit and release). Keys:
values carrying the key's separators, braces, quotes, Lua pattern characters, NUL,
newlines or 200 characters give distinct keys with independent counters, on a real
admission process and Redis; the key function is checked property-style.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.events import Subject
from spendgate.schemas.matching import budget_key
from spendgate.schemas.policies import Policy
from tests.faults.conftest import AdmissionProc, AdmissionProcs, FaultRecord, write_policies
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
SCENARIO = 7

TOKENS = {"tok-acme": ["acme"], "tok-globex": ["globex"], "tok-ops": "*"}
#: Characters that separate, tag, quote or escape somewhere between the key and Redis.
NASTY = ["|", "=", "%", "%7C", "%3D", "%25", "{", "}", "{x}", '"', "'", "\\", "[", "]",
         "%a", "%%", ".", "*", "?", "\x00", "\n", "\r\n", ",", ":", " ", "é", "😀"]  # fmt: skip


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def server(
    services: Services,
    admission_procs: AdmissionProcs,
    key_prefix: str,
    topic_prefix: str,
    tmp_path: Path,
) -> AdmissionProc:
    tokens = tmp_path / "tokens.json"
    import json

    tokens.write_text(json.dumps(TOKENS))
    return admission_procs.start(
        kafka_bootstrap=services.kafka_bootstrap,
        redis_url=services.redis_url,
        topic_prefix=topic_prefix,
        redis_prefix=key_prefix,
        extra_env={"SPENDGATE_AUTH_TOKENS_FILE": str(tokens)},
    )


async def _admit(
    http: httpx.AsyncClient, token: str, subject: dict[str, Any], amount: int, rid: str = ""
) -> httpx.Response:
    return await http.post(
        "/v1/admit",
        headers=_auth(token),
        json={
            "request_id": rid or uuid.uuid4().hex,
            "subject": subject,
            "estimate": {"input_tokens": amount},
        },
    )


def _policy(policy_factory: PolicyFactory) -> Policy:
    return policy_factory(
        id="iso", unit="input_tokens", limit=10**9, group_by=["tenant", "api_key"]
    )


class TestTenantIsolation:
    async def test_a_token_cannot_read_or_charge_another_tenant(
        self,
        services: Services,
        server: AdmissionProc,
        policy_factory: PolicyFactory,
        key_prefix: str,
        fault_record: FaultRecord,
    ) -> None:
        await write_policies(services.redis_url, key_prefix, _policy(policy_factory))
        globex = {"tenant": "globex", "api_key": "g1", "model": "m"}
        tried: Counter[str] = Counter()
        leaks: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            own = await _admit(http, "tok-globex", globex, 50)
            assert own.status_code == 200, own.text
            rid = own.json()["reservation_id"]

            async def expect(what: str, status: int, call: Any) -> None:
                answer = await call
                tried[f"{what} -> {answer.status_code}"] += 1
                fault_record.inputs.append(f"{what}: expect {status}, got {answer.status_code}")
                # The error may echo what was asked; it must not reveal globex's state.
                revealed = rid in answer.text or "iso|" in answer.text
                if answer.status_code != status or revealed:
                    leaks.append(f"{what}: {answer.status_code} {answer.text[:200]}")

            acme = "tok-acme"
            await expect("admit for globex with acme's token", 403, _admit(http, acme, globex, 1))
            await expect(
                "admit with no tenant with acme's token",
                403,
                _admit(http, acme, {"api_key": "g1", "model": "m"}, 1),
            )
            await expect(
                "admit for 'globex ' (trailing space)",
                403,
                _admit(http, acme, {**globex, "tenant": "globex "}, 1),
            )
            await expect(
                "admit for 'acme|api_key=g1'",
                403,
                _admit(http, acme, {**globex, "tenant": "acme|api_key=g1"}, 1),
            )
            await expect(
                "budgets of globex with acme's token",
                403,
                http.get(
                    "/v1/budgets", params={"tenant": "globex", "api_key": "g1"}, headers=_auth(acme)
                ),
            )
            await expect(
                "budgets without tenant with acme's token",
                403,
                http.get("/v1/budgets", params={"api_key": "g1"}, headers=_auth(acme)),
            )
            await expect(
                "commit globex's reservation with acme's token",
                403,
                http.post(
                    "/v1/commit",
                    headers=_auth(acme),
                    json={"reservation_id": rid, "usage": {"input_tokens": 0}},
                ),
            )
            await expect(
                "release globex's reservation with acme's token",
                403,
                http.post("/v1/release", headers=_auth(acme), json={"reservation_id": rid}),
            )
            for what, header in [
                ("no Authorization header", None),
                ("unknown token", "Bearer tok-nobody"),
                ("token prefix", "Bearer tok-acm"),
                ("token with suffix", "Bearer tok-acmeX"),
                ("token in other case", "Bearer TOK-ACME"),
                ("Basic scheme", "Basic dG9rLWFjbWU6"),
                ("bearer without a token", "Bearer"),
            ]:
                headers = {"Authorization": header} if header else {}
                await expect(f"admit for acme, {what}", 401, http.post(
                    "/v1/admit", headers=headers,
                    json={"request_id": uuid.uuid4().hex,
                          "subject": {"tenant": "acme", "api_key": "a", "model": "m"},
                          "estimate": {"input_tokens": 1}}))  # fmt: skip
            # globex's reservation is untouched and still its own to settle.
            view = await http.get(
                "/v1/budgets", params={"tenant": "globex", "api_key": "g1"},
                headers=_auth("tok-globex"),
            )  # fmt: skip
            reserved = view.json()["budgets"][0]["reserved"]
            settle = await http.post(
                "/v1/commit", headers=_auth("tok-globex"),
                json={"reservation_id": rid, "usage": {"input_tokens": 7}},
            )  # fmt: skip
        fault_record.add(
            events_checked=sum(tried.values()),
            answers=dict(tried),
            leaks_or_wrong_status=leaks,
            globex_reserved_after=reserved,
            globex_commit_status=settle.status_code,
        )
        assert not leaks
        assert reserved == 50
        assert settle.status_code == 202

    async def test_the_same_request_id_from_two_tenants_is_two_requests(
        self,
        services: Services,
        server: AdmissionProc,
        policy_factory: PolicyFactory,
        key_prefix: str,
        fault_record: FaultRecord,
    ) -> None:
        await write_policies(services.redis_url, key_prefix, _policy(policy_factory))
        rid = f"req-{uuid.uuid4().hex[:6]}"
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            first = await _admit(
                http, "tok-globex", {"tenant": "globex", "api_key": "g", "model": "m"}, 500, rid
            )
            second = await _admit(
                http, "tok-acme", {"tenant": "acme", "api_key": "a", "model": "m"}, 300, rid
            )
            acme_view = await http.get(
                "/v1/budgets", params={"tenant": "acme", "api_key": "a"},
                headers=_auth("tok-acme"),
            )  # fmt: skip
        fault_record.fault("tenant globex admits request_id R; tenant acme then admits R too")
        leaked = "globex" in second.text
        same = first.json().get("reservation_id") == second.json().get("reservation_id")
        acme_reserved = acme_view.json()["budgets"][0]["reserved"]
        fault_record.add(
            globex_status=first.status_code,
            acme_status=second.status_code,
            acme_got_globex_reservation=same,
            acme_answer_names_globex_key=leaked,
            acme_reserved_units=acme_reserved,
            acme_units_admitted_without_reservation=300 - acme_reserved if same else 0,
        )
        assert not same and not leaked
        assert acme_reserved == 300


class TestKeyCollisions:
    def test_distinct_values_give_distinct_keys(self, fault_record: FaultRecord) -> None:
        policy = Policy.model_validate(
            {"id": "p", "unit": "requests", "limit": 1, "window": "1m", "bucket": "5s",
             "group_by": ["tenant", "api_key", "labels.x|y=z"]}
        )  # fmt: skip
        value = st.lists(
            st.sampled_from(NASTY) | st.text(min_size=1, max_size=4), min_size=1, max_size=4
        ).map(lambda parts: "".join(parts)[:200])
        tried = {"pairs": 0, "distinct_pairs": 0, "collisions": 0}

        @given(a=value, b=value, c=value, d=value)
        def check(a: str, b: str, c: str, d: str) -> None:
            one = Subject(tenant=a, api_key=b, labels={"x|y=z": "v"})
            two = Subject(tenant=c, api_key=d, labels={"x|y=z": "v"})
            k1, k2 = budget_key(policy, one), budget_key(policy, two)
            tried["pairs"] += 1
            if (a, b) != (c, d):
                tried["distinct_pairs"] += 1
                tried["collisions"] += int(k1 == k2)
                assert k1 != k2
            for key in (k1, k2):
                assert "{" not in key and "}" not in key  # no Redis Cluster hash tag

        try:
            check()
        finally:
            fault_record.fault("hypothesis: random value pairs built from key separators, "
                               "braces, quotes, Lua pattern characters, NUL, newlines")  # fmt: skip
            fault_record.add(events_checked=tried["pairs"], **tried)
        # The run drew pairs that differ (a run of equal pairs proves nothing), none collided.
        assert tried["distinct_pairs"] > 0 and tried["collisions"] == 0, tried

    async def test_crafted_values_reach_only_their_own_counter(
        self,
        services: Services,
        server: AdmissionProc,
        policy_factory: PolicyFactory,
        key_prefix: str,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        await write_policies(services.redis_url, key_prefix, _policy(policy_factory))
        # Pairs that collide under naive "policy|tenant=T|api_key=K" building, and worse.
        subjects = [
            ("a|api_key=b", "c"), ("a", "b|api_key=c"),
            ("a=b", "c"), ("a", "=b|c"), ("a%7Cb", "c"), ("a|b", "c"),
            ("a%", "c"), ("a%25", "c"), ("{t}", "c"), ("t", "{c}"), ("{t", "}c"),
            ('"a"', "c"), ("'a'", "c"), ("a\\", "c"), ("a\\|", "c"),
            ("a[", "c"), ("a]", "c"), ("a%a", "c"), ("a.*", "c"), ("a\x00", "c"),
            ("a\x00|api_key=c", "c"), ("a\n", "c"), ("a\r\n", "c"), ("a,1", "c"),
            ("a" * 200, "c"), ("a" * 199 + "|", "c"), ("a", "c" * 200),
            ("é", "c"), ("e\u0301", "c"),
        ]  # fmt: skip
        amounts = {}
        keys: dict[str, tuple[str, str]] = {}
        problems: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            for i, (tenant, api_key) in enumerate(subjects):
                amount = i + 1
                subject = {"tenant": tenant, "api_key": api_key, "model": "m"}
                answer = await _admit(http, "tok-ops", subject, amount)
                fault_record.inputs.append(f"subject tenant={tenant!r} api_key={api_key!r}")
                if answer.status_code != 200:
                    problems.append(f"{tenant!r},{api_key!r}: {answer.status_code}")
                    continue
                key = answer.json()["budgets"][0]["key"]
                if key in keys:
                    problems.append(f"{(tenant, api_key)!r} and {keys[key]!r} share key {key!r}")
                keys[key] = (tenant, api_key)
                amounts[(tenant, api_key)] = amount
            # Each counter holds exactly its own reservation, read back through the API.
            for (tenant, api_key), amount in amounts.items():
                view = await http.get(
                    "/v1/budgets", params={"tenant": tenant, "api_key": api_key},
                    headers=_auth("tok-ops"),
                )  # fmt: skip
                got = view.json()["budgets"][0]["reserved"] if view.status_code == 200 else None
                if got != amount:
                    problems.append(f"{(tenant, api_key)!r}: reserved {got}, expected {amount}")
        pending = [k for k in redis_sync.scan_iter(match=f"{key_prefix}pw:*")]
        fault_record.add(
            events_checked=len(subjects),
            distinct_keys=len(keys),
            redis_pending_hashes=len(pending),
            collisions_or_wrong_counters=problems,
        )
        assert not problems
        assert len(keys) == len(subjects) == len(pending)
