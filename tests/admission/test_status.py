"""``GET /v1/status`` and ``admission.status``: can the stack decide (issue 23, item 7).

The marks are written by hand, as a worker would leave them (``tests/admission/
test_unvouched.py`` does the same for the admit script), on a real Redis; each state the
status reports is checked against what the admit script answers on the same marks.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from spendgate.admission.auth import Authorizer
from spendgate.admission.status import read_status, read_status_sync
from spendgate.demo import wait_until_decidable
from spendgate.schemas.redis_keys import mark_owners_key, mark_progress_key, marks_key, topology_key
from spendgate.schemas.shards import partition_for, usage_mark
from spendgate.streams.materialize import RedisMaterializer
from tests.fixtures.admission import (
    TOPOLOGY,
    VOUCHED,
    Admission,
    LiveServer,
    MakeAdmission,
    free_port,
)
from tests.fixtures.factories import PolicyFactory

pytestmark = pytest.mark.integration

STALENESS_MS = 30_000


async def _redis_now_ms(adm: Admission) -> int:
    seconds, micros = await adm.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _topology(adm: Admission) -> None:
    """The topology a worker writes beside the policies, with no mark yet."""
    await RedisMaterializer(adm.redis, adm.prefix).write_policies([], TOPOLOGY)


async def _status(adm: Admission, **headers: str) -> dict[str, object]:
    answer = await adm.http.get("/v1/status", headers=headers)
    assert answer.status_code == 200, answer.text
    body: dict[str, object] = answer.json()
    return body


class TestNoTopology:
    async def test_nothing_is_decidable_and_the_reason_says_why(
        self, make_admission: MakeAdmission
    ) -> None:
        adm = await make_admission()
        body = await _status(adm)
        assert body["decidable"] is False
        assert body["topology"] is None and body["partitions"] == []
        assert "no topology" in str(body["reason"])
        assert body["counts"] == {"vouched": 0, "stale": 0, "missing": 0}
        assert body["staleness_ms"] == STALENESS_MS
        assert abs(int(body["redis_time_ms"]) - await _redis_now_ms(adm)) < 5_000  # type: ignore[call-overload]

    async def test_readyz_stays_ready_while_the_stack_cannot_decide(
        self, make_admission: MakeAdmission
    ) -> None:
        # The admission process is fine; the worker is absent: failure modes can answer.
        adm = await make_admission()
        assert (await adm.http.get("/readyz")).status_code == 200
        assert (await _status(adm))["decidable"] is False


class TestStates:
    async def test_missing_every_mark_of_the_topology(self, make_admission: MakeAdmission) -> None:
        adm = await make_admission()
        await _topology(adm)
        status = await read_status(adm.redis, adm.prefix, STALENESS_MS)
        assert not status.decidable
        assert [p.field for p in status.partitions] == list(TOPOLOGY.all_marks())
        assert {p.state for p in status.partitions} == {"missing"}
        assert all(p.watermark_ms is None and p.age_ms is None for p in status.partitions)
        assert status.counts == {"vouched": 0, "stale": 0, "missing": 8}
        assert status.topology is not None and status.topology.usage == TOPOLOGY.usage
        assert "8 of 8 marks not vouched" in (status.reason or "")

    async def test_vouched_stale_and_missing_side_by_side(
        self, make_admission: MakeAdmission
    ) -> None:
        adm = await make_admission()
        await _topology(adm)
        now = await _redis_now_ms(adm)
        await adm.redis.hset(
            marks_key(adm.prefix),
            mapping={"usage:0": now, "usage:1": now - STALENESS_MS - 5_000, "keyed:0": now},
        )
        status = await read_status(adm.redis, adm.prefix, STALENESS_MS)
        by = {p.field: p for p in status.partitions}
        assert by["usage:0"].state == "vouched" and by["keyed:0"].state == "vouched"
        assert by["usage:1"].state == "stale"
        assert by["usage:2"].state == "missing" and by["keyed:3"].state == "missing"
        assert by["usage:0"].watermark_ms == now
        fresh, old = by["usage:0"].age_ms, by["usage:1"].age_ms
        assert fresh is not None and 0 <= fresh < 5_000
        assert old is not None and STALENESS_MS + 5_000 <= old < STALENESS_MS + 10_000
        assert by["usage:1"].topic == "usage" and by["usage:1"].partition == 1
        assert by["keyed:3"].topic == "keyed" and by["keyed:3"].partition == 3
        assert status.counts == {"vouched": 2, "stale": 1, "missing": 5}
        assert not status.decidable
        assert "usage:1 stale" in (status.reason or "")

    async def test_every_mark_vouched_is_decidable(self, make_admission: MakeAdmission) -> None:
        adm = await make_admission()
        await _topology(adm)
        await adm.marks(await _redis_now_ms(adm))
        body = await _status(adm)
        assert body["decidable"] is True and body["reason"] is None
        assert body["counts"] == {"vouched": 8, "stale": 0, "missing": 0}
        assert body["topology"] == {"usage": 4, "keyed": 4}

    async def test_the_bound_is_this_admissions_staleness(
        self, make_admission: MakeAdmission
    ) -> None:
        adm = await make_admission(staleness_s=5.0)
        await _topology(adm)
        await adm.marks(await _redis_now_ms(adm) - 10_000)
        body = await _status(adm)
        assert body["staleness_ms"] == 5_000
        assert body["counts"] == {"vouched": 0, "stale": 8, "missing": 0}

    @pytest.mark.parametrize(
        ("offset_ms", "state", "code"),
        [(0, "vouched", 200), (-(STALENESS_MS + 10_000), "stale", 503), (None, "missing", 503)],
    )
    async def test_each_state_is_the_one_the_admit_script_decides_on(
        self,
        make_admission: MakeAdmission,
        policy_factory: PolicyFactory,
        offset_ms: int | None,
        state: str,
        code: int,
    ) -> None:
        adm = await make_admission()
        await adm.policies(policy_factory(failure="closed", unit="input_tokens"))
        await adm.marks(None if offset_ms is None else await _redis_now_ms(adm) + offset_ms)
        field = usage_mark(partition_for(b"acme", TOPOLOGY.usage))
        status = await read_status(adm.redis, adm.prefix, STALENESS_MS)
        assert {p.field: p.state for p in status.partitions}[field] == state
        assert status.policies == 1
        answer = await adm.admit("acme", input_tokens=1)
        assert answer.status_code == code, answer.text
        if code == 503:
            assert answer.json()["error"]["state"] == state


class TestLagAndToken:
    async def test_progress_and_fencing_token_are_parsed(
        self, make_admission: MakeAdmission
    ) -> None:
        adm = await make_admission()
        await _topology(adm)
        now = await _redis_now_ms(adm)
        await adm.marks(now)
        await adm.redis.hset(
            mark_progress_key(adm.prefix),
            mapping={"usage:0": f"12:{now - 700}", "usage:1": "garbage", "keyed:0": f"0:{now}"},
        )
        await adm.redis.hset(mark_owners_key(adm.prefix), mapping={"usage:0": 7, "keyed:0": "3"})
        status = await read_status(adm.redis, adm.prefix, STALENESS_MS)
        by = {p.field: p for p in status.partitions}
        lag = by["usage:0"].lag
        assert lag is not None and lag.records_behind == 12 and lag.measured_at_ms == now - 700
        assert 700 <= lag.age_ms < 10_000
        assert by["usage:0"].owner_token == 7 and by["keyed:0"].owner_token == 3
        assert by["keyed:0"].lag is not None and by["keyed:0"].lag.records_behind == 0
        # Unparsable or absent: null, never an error (the marks still decide).
        assert by["usage:1"].lag is None and by["usage:2"].lag is None
        assert by["usage:1"].owner_token is None
        assert status.decidable

    async def test_sync_reader_answers_the_same(
        self, make_admission: MakeAdmission, redis_sync: redis.Redis
    ) -> None:
        adm = await make_admission()
        await _topology(adm)
        await adm.marks(await _redis_now_ms(adm))
        await adm.redis.hset(mark_owners_key(adm.prefix), "usage:2", 9)
        a = await read_status(adm.redis, adm.prefix, STALENESS_MS)
        b = read_status_sync(redis_sync, adm.prefix, STALENESS_MS)
        strip = {"redis_time_ms": 0}
        assert a.model_copy(update=strip).model_dump(exclude={"partitions"}) == b.model_copy(
            update=strip
        ).model_dump(exclude={"partitions"})
        assert [(p.field, p.state, p.owner_token) for p in a.partitions] == [
            (p.field, p.state, p.owner_token) for p in b.partitions
        ]

    async def test_a_topology_lost_with_its_marks_is_not_decidable(
        self, make_admission: MakeAdmission
    ) -> None:
        adm = await make_admission()
        await _topology(adm)
        await adm.marks(await _redis_now_ms(adm))
        await adm.redis.delete(topology_key(adm.prefix))
        assert not (await read_status(adm.redis, adm.prefix, STALENESS_MS)).decidable


class TestAuthAndFailures:
    @pytest.mark.parametrize(
        ("token", "code"),
        [
            ("tok-ops", 200),
            ("tok-all", 200),
            ("tok-acme", 403),
            ("tok-nobody", 401),
            (None, 401),
        ],
    )
    async def test_only_tokens_reading_every_tenant(
        self, make_admission: MakeAdmission, token: str | None, code: int
    ) -> None:
        grants = {"tok-ops": "operator", "tok-all": None, "tok-acme": frozenset({"acme"})}
        adm = await make_admission(authorizer=Authorizer(grants))  # type: ignore[arg-type]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        answer = await adm.http.get("/v1/status", headers=headers)
        assert answer.status_code == code, answer.text
        if code != 200:
            assert answer.json()["error"]["code"] in {"forbidden", "unauthorized"}

    async def test_redis_unreachable_is_a_503(self, make_admission: MakeAdmission) -> None:
        adm = await make_admission(redis_url=f"redis://127.0.0.1:{free_port()}/0")
        answer = await adm.http.get("/v1/status")
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "store_unavailable"

    async def test_documented_in_the_openapi_document(self, make_admission: MakeAdmission) -> None:
        adm = await make_admission()
        doc = (await adm.http.get("/openapi.json")).json()
        ok = doc["paths"]["/v1/status"]["get"]["responses"]["200"]
        assert ok["content"]["application/json"]["schema"]["$ref"].endswith("/StackStatus")
        assert "PartitionStatus" in doc["components"]["schemas"]


class TestDemoWaits:
    def test_the_demo_waits_on_the_status(
        self, live_admission: LiveServer, redis_sync: redis.Redis, policy_factory: PolicyFactory
    ) -> None:
        url, prefix = live_admission.url, live_admission.settings.redis_prefix
        with pytest.raises(TimeoutError, match="no topology"):
            wait_until_decidable(url, 0.5, token="tok-all", poll_s=0.1)
        with pytest.raises(TimeoutError, match="403"):
            wait_until_decidable(url, 0.2, token="tok-acme", poll_s=0.1)

        async def stand_in() -> None:
            client = aioredis.Redis.from_url(live_admission.settings.redis_url)
            await RedisMaterializer(client, prefix).stand_in([policy_factory()], TOPOLOGY, VOUCHED)
            await client.aclose()

        asyncio.run(stand_in())
        status = wait_until_decidable(url, 10, token="tok-all", poll_s=0.1)
        assert status["decidable"] is True and status["policies"] == 1
        redis_sync.hdel(marks_key(prefix), "keyed:2")
        with pytest.raises(TimeoutError, match="keyed:2 missing"):
            wait_until_decidable(url, 0.3, token="tok-all", poll_s=0.1)
