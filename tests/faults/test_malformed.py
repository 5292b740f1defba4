"""Scenario 5: malformed input to the usage topic and to the HTTP API.

Topic: every malformed record is dead-lettered with a reason and its exact bytes,
processing goes on, and every valid window equals the exact ledger. HTTP: every malformed
request gets a 4xx with a JSON error naming what is wrong, and nothing in Redis or on the
usage topic changes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import redis

from spendgate.schemas.deadletter import MAX_ORIGINAL_BYTES, DeadLetter
from spendgate.schemas.redis_keys import unpublished_reserves_key
from spendgate.streams.replay import replay
from spendgate.streams.settings import WorkerSettings
from tests.faults.conftest import (
    AdmissionProcs,
    FaultRecord,
    compare,
    read_buckets,
    read_topic,
    snapshot,
    write_policies,
)
from tests.fixtures.consumption import wait_consumed
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.kafka_io import eventually, produce
from tests.fixtures.pipeline import ApplyPolicies, Workers
from tests.fixtures.seeds import rng as seeded
from tests.fixtures.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SCENARIO = 5


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _event(tenant: str, amount: Any, occurred: Any, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "schema_version": 1,
        "event_id": uuid.uuid4().hex,
        "kind": "commit",
        "occurred_at": occurred,
        "subject": {"tenant": tenant, "model": "m"},
        "usage": {"input_tokens": amount},
    }
    body.update(extra)
    return body


def _malformed_records(now_ms: int) -> list[tuple[str, bytes]]:
    """(what, raw value) pairs that are not valid usage events."""
    rng = seeded("malformed.topic.random_bytes")
    ok = _event("bad", 5, _iso(now_ms))

    def with_(**changes: Any) -> bytes:
        body = json.loads(json.dumps(ok))
        body["event_id"] = uuid.uuid4().hex
        for name, value in changes.items():
            if value is ...:
                body.pop(name)
            else:
                body[name] = value
        return json.dumps(body).encode()

    out: list[tuple[str, bytes]] = [
        (f"random bytes #{i}", bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))))
        for i in range(8)
    ]
    out += [
        ("empty value", b""),
        ("JSON null", b"null"),
        ("JSON array", b"[1, 2, 3]"),
        ("JSON string", b'"commit"'),
        ("truncated JSON", with_()[:-7]),
        ("invalid UTF-8 in a string", with_(event_id="XX").replace(b'"XX"', b'"\xff\xfe"')),
        ("lone surrogate escape", with_(event_id="XX").replace(b'"XX"', b'"\\ud800"')),
        ("UTF-8 BOM before JSON", b"\xef\xbb\xbf" + with_()),
        ("NaN amount", with_(usage={"input_tokens": 1}).replace(b": 1}", b": NaN}")),
        ("amount 2**53 (over the exact-double limit)", with_(usage={"input_tokens": 2**53})),
        ("amount 2**63", with_(usage={"input_tokens": 2**63})),
        ("amount 2**64 + 1", with_(usage={"input_tokens": 2**64 + 1})),
        ("amount 10**400", with_(usage={"input_tokens": 10**400})),
        ("amount 1e308", with_(usage={"input_tokens": 1e308})),
        ("negative amount -1", with_(usage={"input_tokens": -1})),
        ("negative amount -2**63", with_(usage={"input_tokens": -(2**63)})),
        ("fractional amount 1.5", with_(usage={"input_tokens": 1.5})),
        ("amount as a word", with_(usage={"input_tokens": "lots"})),
        ("amount as an object", with_(usage={"input_tokens": {"n": 1}})),
        ("adjust beyond -2**53", with_(kind="adjust", usage={"input_tokens": -(2**53)})),
        ("unknown usage field", with_(usage={"input_tokenz": 5})),
        ("unknown kind 'refund'", with_(kind="refund")),
        ("kind missing", with_(kind=...)),
        ("kind as a number", with_(kind=1)),
        ("schema_version 2", with_(schema_version=2)),
        ("event_id missing", with_(event_id=...)),
        ("event_id empty", with_(event_id="")),
        ("subject value 201 chars", with_(subject={"tenant": "t" * 201})),
        ("subject with an unknown field", with_(subject={"tenant": "bad", "org": "x"})),
        ("subject labels nested", with_(subject={"tenant": "bad", "labels": {"a": {"b": 1}}})),
        ("33 labels", with_(subject={"tenant": "bad", "labels": {str(i): "v" for i in range(33)}})),
        ("unknown top-level field", with_(extra=1)),
        ("deeply nested JSON (20000 levels)", b"[" * 20_000 + b"]" * 20_000),
        ("deeply nested usage", with_(usage=json.loads("[" * 150 + "]" * 150))),
        ("occurred_at naive", with_(occurred_at="2026-01-01T00:00:00")),
        ("occurred_at not a date", with_(occurred_at="yesterday")),
        ("occurred_at year 99999", with_(occurred_at="99999-01-01T00:00:00Z")),
        ("occurred_at 10**20 (number)", with_(occurred_at=10**20)),
        ("occurred_at month 13", with_(occurred_at="2026-13-01T00:00:00Z")),
        (
            "reserve expiring before it starts",
            with_(kind="reserve", reservation_id="r", expires_at=_iso(now_ms - 1000)),
        ),
        ("release without reservation_id", with_(kind="release", usage=...)),
    ]
    return out


class TestMalformedTopic:
    async def test_malformed_records_are_dead_lettered_and_nothing_else_changes(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens", limit=10**12, window="1h", bucket="1m", group_by=["tenant"]
        )
        now_ms = int(time.time() * 1000)
        rng = seeded("malformed.topic.valid")
        expected: dict[str, dict[int, int]] = {}

        def valid(tenant: str, amount: int, occurred_ms: int) -> tuple[bytes, bytes]:
            key = f"{policy.id}|tenant={tenant}"
            buckets = expected.setdefault(key, {})
            bucket = occurred_ms - occurred_ms % policy.bucket_ms  # aligned to the epoch
            buckets[bucket] = buckets.get(bucket, 0) + amount
            body = _event(tenant, amount, _iso(occurred_ms))
            return tenant.encode(), json.dumps(body).encode()

        before = [
            valid(f"v{rng.randrange(6)}", rng.randint(1, 300), now_ms - rng.randint(0, 1_200_000))
            for _ in range(300)
        ]
        malformed = _malformed_records(now_ms)
        after = [
            valid(f"v{rng.randrange(6)}", rng.randint(1, 300), now_ms - rng.randint(0, 1_200_000))
            for _ in range(300)
        ]
        # Valid but odd: counted per the documented rules, not dead-lettered.
        odd_counted = [
            # occurred_at far in the future: clamped to the broker timestamp.
            ("future", json.dumps(_event("future", 40, "9999-12-31T23:59:59Z")).encode()),
            # Two ancient, on keys whose clock is now: dropped as late (change nothing).
            ("v0", json.dumps(_event("v0", 1000, "1971-01-01T00:00:00Z")).encode()),
            # Three windows before now: a bucket of its own, were it counted.
            ("v1", json.dumps(_event("v1", 700, _iso(now_ms - 3 * policy.window_ms))).encode()),
        ]
        # Before the Unix epoch: refused (dead-lettered), since buckets align to the epoch.
        malformed.append(
            ("year 1", json.dumps(_event("v1", 1000, "0001-01-01T00:00:00Z")).encode())
        )
        workers.start()
        await apply_policies(policy)
        topic, bootstrap = worker_settings.topic("usage"), worker_settings.kafka_bootstrap
        await produce(bootstrap, topic, before)
        await produce(bootstrap, topic, [(b"bad", raw) for _, raw in malformed])
        await produce(bootstrap, topic, [(t.encode(), raw) for t, raw in odd_counted])
        await produce(bootstrap, topic, after)
        for what, _ in malformed:
            fault_record.inputs.append(f"topic: {what}")
        fault_record.fault(
            f"{len(malformed)} malformed records between {len(before)} valid records before "
            f"and {len(after)} after; plus a far-future and two ancient valid events"
        )
        prefix = worker_settings.redis_prefix
        dlq_topic = worker_settings.topic("dlq")
        letters: list[DeadLetter] = []

        # Every record read and acknowledged by the worker (the valid ones after the
        # malformed ones included), then the dead letters and the windows.
        await wait_consumed(bootstrap, worker_settings.app_id, topic, timeout_s=240)
        raw_letters = await read_topic(bootstrap, dlq_topic, len(malformed), 60)
        letters = [DeadLetter.model_validate_json(v) for v in raw_letters]
        future_key = f"{policy.id}|tenant=future"
        # The far-future event's bucket follows the broker's clock: checked apart below.
        await eventually(
            lambda: compare(redis_sync, prefix, expected, checked_apart={future_key}).exact,
            timeout_s=60,
            what="valid windows equal to the ledger",
        )
        final = compare(redis_sync, prefix, expected, checked_apart={future_key})
        by_raw = {base64.b64encode(raw).decode(): what for what, raw in malformed}
        lettered = [by_raw[d.original_b64] for d in letters if d.original_b64 in by_raw]
        missing = [what for what, _ in malformed if what not in lettered]
        future = sum(read_buckets(redis_sync, prefix, future_key).values())
        fault_record.add(
            events_checked=len(before) + len(after) + len(malformed) + len(odd_counted),
            malformed_records=len(malformed),
            dead_lettered=len(letters),
            dead_letters_with_reason=sum(bool(d.reason) for d in letters),
            malformed_not_dead_lettered=missing,
            valid_units_expected=final.units_expected,
            valid_units_held=final.units_held,
            units_lost=final.units_lost,
            units_double_counted=final.units_double_counted,
            far_future_event_counted_units=future,
        )
        assert not missing
        # One letter per malformed record, each carrying its exact bytes, and no other.
        assert sorted(lettered) == sorted(what for what, _ in malformed)
        assert len(letters) == len(malformed)
        assert all(d.reason and d.topic == topic and d.offset is not None for d in letters)
        assert all(not d.truncated and d.original_size in (0, len(d.raw)) for d in letters)
        # The two ancient events changed nothing, the malformed ones neither (no window
        # under any other key), and every valid one is counted once: what Redis holds under
        # the prefix is the ledger of the valid events.
        assert final.units_held == sum(sum(b.values()) for b in expected.values())
        assert final.keys_missing == final.keys_unexpected == ()
        assert (final.units_lost, final.units_double_counted) == (0, 0)
        assert final.exact
        assert future == 40
        bucket = max(read_buckets(redis_sync, prefix, future_key))
        assert abs(bucket - now_ms) < 10 * 60_000, "far-future event not clamped to broker time"

    async def test_an_oversized_record_is_dead_lettered(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=10**12, group_by=["tenant"])
        worker = workers.start()
        await apply_policies(policy)
        topic, bootstrap = worker_settings.topic("usage"), worker_settings.kafka_bootstrap
        now_ms = int(time.time() * 1000)
        raw = json.dumps(_event("big", 5, _iso(now_ms), event_id="x" * 600_000)).encode()
        # A valid record right behind it, on the same partition (same key): processing
        # must go on past the oversized one.
        after = json.dumps(_event("after", 11, _iso(now_ms))).encode()
        await produce(bootstrap, topic, [(b"big", raw), (b"big", after)])
        fault_record.inputs.append("topic: a 600 kB record (event_id of 600,000 characters)")
        fault_record.fault("one oversized record (under the broker's 1 MB limit), then a valid one")
        dlq = worker_settings.topic("dlq")
        prefix = worker_settings.redis_prefix
        await wait_consumed(bootstrap, worker_settings.app_id, topic, timeout_s=120)
        await eventually(
            lambda: (
                sum(read_buckets(redis_sync, prefix, f"{policy.id}|tenant=after").values()) == 11
            ),
            timeout_s=60,
            what="the valid record after the oversized one counted",
        )
        values = await read_topic(bootstrap, dlq, 1, 60)
        letters = [DeadLetter.model_validate_json(v) for v in values]
        counted_after = sum(read_buckets(redis_sync, prefix, f"{policy.id}|tenant=after").values())
        counted_big = sum(read_buckets(redis_sync, prefix, f"{policy.id}|tenant=big").values())
        alive = worker.poll() is None
        log = (workers.logs / "worker-w1.log").read_text(errors="replace")
        crashes = [
            line for line in log.splitlines() if "Crashed reason=" in line or "Traceback" in line
        ]
        letter = letters[0] if letters else None
        fault_record.add(
            dead_lettered=len(letters),
            record_bytes=len(raw),
            letter_bytes=max((len(v) for v in values), default=0),
            letter_original_bytes=len(letter.raw) if letter else None,
            letter_original_size=letter.original_size if letter else None,
            letter_sha256_matches=bool(letter)
            and letter.original_sha256 == hashlib.sha256(raw).hexdigest(),
            letter_truncated=letter.truncated if letter else None,
            valid_record_after_counted_units=counted_after,
            oversized_units_counted=counted_big,
            worker_alive=alive,
            worker_log_crash_lines=crashes[:5],
        )
        assert len(letters) == 1 and letter is not None
        # Capped at the first 64 KiB, with the whole record's size and SHA-256.
        assert letter.truncated
        assert letter.raw == raw[:MAX_ORIGINAL_BYTES]
        assert MAX_ORIGINAL_BYTES == 64 * 1024
        assert letter.original_size == len(raw)
        assert letter.original_sha256 == hashlib.sha256(raw).hexdigest()
        assert letter.topic == topic and letter.offset is not None and letter.reason
        assert max(len(v) for v in values) < 1_000_000  # fits a default Kafka record
        # Processing went on: the next record counted, the oversized one not, the worker
        # process still running and its log free of any crash.
        assert counted_after == 11
        assert counted_big == 0
        assert alive
        assert not crashes, crashes

    async def test_a_pre_epoch_timestamp_neither_crashes_the_worker_nor_the_replay(
        self,
        workers: Workers,
        worker_settings: WorkerSettings,
        apply_policies: ApplyPolicies,
        policy_factory: PolicyFactory,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(
            unit="input_tokens", limit=10**12, window="1h", bucket="1m", group_by=["tenant"]
        )
        now_ms = int(time.time() * 1000)
        workers.start()
        await apply_policies(policy)
        topic, bootstrap = worker_settings.topic("usage"), worker_settings.kafka_bootstrap
        # occurred_at -1 is 1969-12-31T23:59:59.999Z: a valid instant, the first on its key.
        poison = json.dumps(_event("fresh", 5, -1)).encode()
        later = json.dumps(_event("after", 7, _iso(now_ms))).encode()
        await produce(bootstrap, topic, [(b"same", poison), (b"same", later)])
        fault_record.inputs.append("topic: occurred_at -1 (1969-12-31T23:59:59.999Z), fresh key")
        fault_record.fault("one pre-epoch event on a fresh budget key, then one valid event")
        key = f"{policy.id}|tenant=after"
        prefix = worker_settings.redis_prefix
        await wait_consumed(bootstrap, worker_settings.app_id, topic, timeout_s=120)
        counted_after = sum(read_buckets(redis_sync, prefix, key).values())
        fresh = sum(read_buckets(redis_sync, prefix, f"{policy.id}|tenant=fresh").values())
        letters = [
            DeadLetter.model_validate_json(v)
            for v in await read_topic(bootstrap, worker_settings.topic("dlq"), 1, 60)
        ]
        workers.stop_all()
        log = (workers.logs / "worker-w1.log").read_text(errors="replace")
        crashed = "Crashed reason=ValueError('bucket start -" in log
        replay_error = None
        try:
            await replay(worker_settings)  # restores this test's own key prefix
        except ValueError as exc:
            replay_error = str(exc)
        fault_record.add(
            processing_continued=counted_after == 7,
            pre_epoch_dead_lettered=[d.raw == poison for d in letters].count(True),
            pre_epoch_units_counted=fresh,
            account_agent_crashed=crashed,
            replay_error=replay_error,
        )
        assert counted_after == 7  # the record after it was processed
        assert [d.raw for d in letters] == [poison]  # refused, with its exact bytes
        assert fresh == 0
        assert not crashed
        assert replay_error is None


# --- HTTP --------------------------------------------------------------------------------

_OK: dict[str, Any] = {
    "request_id": "r",
    "subject": {"tenant": "acme", "model": "m1"},
    "estimate": {"input_tokens": 10},
}


def _body(**changes: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(_OK))
    body["request_id"] = uuid.uuid4().hex
    for path, value in changes.items():
        target = body
        parts = path.split("__")
        for part in parts[:-1]:
            target = target[part]
        if value is ...:
            target.pop(parts[-1])
        else:
            target[parts[-1]] = value
    return body


async def _chunks() -> Any:
    for part in (b'{"a": "', b"x" * 300_000, b"x" * 300_000, b'"}'):
        yield part


def _http_cases() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(what, method, path, httpx request kwargs)."""
    rng = seeded("malformed.http.random_bytes")
    j = {"content-type": "application/json"}
    cases: list[tuple[str, str, str, dict[str, Any]]] = [
        (f"random bytes #{i}", "POST", "/v1/admit",
         {"content": bytes(rng.randrange(256) for _ in range(200)), "headers": j})
        for i in range(5)
    ]  # fmt: skip
    raw = json.dumps(_body()).encode()
    cases += [
        ("empty body", "POST", "/v1/admit", {"content": b"", "headers": j}),
        ("JSON null", "POST", "/v1/admit", {"content": b"null", "headers": j}),
        ("JSON array", "POST", "/v1/admit", {"content": b"[]", "headers": j}),
        ("truncated JSON", "POST", "/v1/admit", {"content": raw[:-5], "headers": j}),
        ("invalid UTF-8 in a string", "POST", "/v1/admit",
         {"content": raw.replace(b'"acme"', b'"ac\xffme"'), "headers": j}),
        ("lone surrogate escape", "POST", "/v1/admit",
         {"content": raw.replace(b'"acme"', b'"\\ud800"'), "headers": j}),
        ("NaN estimate", "POST", "/v1/admit",
         {"content": raw.replace(b'"input_tokens": 10', b'"input_tokens": NaN'), "headers": j}),
        ("Infinity estimate", "POST", "/v1/admit",
         {"content": raw.replace(b'"input_tokens": 10', b'"input_tokens": Infinity'),
          "headers": j}),
        ("text/plain content type", "POST", "/v1/admit",
         {"content": raw, "headers": {"content-type": "text/plain"}}),
        ("no content type", "POST", "/v1/admit", {"content": raw, "headers": {}}),
        ("oversized body 1 MB (content-length)", "POST", "/v1/admit",
         {"content": b'{"a": "' + b"x" * 1_000_000 + b'"}', "headers": j}),
        ("oversized chunked body, no content-length", "POST", "/v1/admit",
         {"content": _chunks(), "headers": j}),
        ("deeply nested JSON (30000 levels)", "POST", "/v1/admit",
         {"content": b"[" * 30_000 + b"]" * 30_000, "headers": j}),
        ("deeply nested object in estimate", "POST", "/v1/admit",
         {"content": json.dumps(_body()).replace('{"input_tokens": 10}',
                                                 '{"a":' * 5000 + "1" + "}" * 5000).encode(),
          "headers": j}),
    ]  # fmt: skip
    for what, changes in [
        ("estimate 2**53", {"estimate__input_tokens": 2**53}),
        ("estimate 2**63", {"estimate__input_tokens": 2**63}),
        ("estimate 2**64+1", {"estimate__input_tokens": 2**64 + 1}),
        ("estimate 10**400", {"estimate__input_tokens": 10**400}),
        ("estimate 1e308", {"estimate__input_tokens": 1e308}),
        ("estimate -1", {"estimate__input_tokens": -1}),
        ("estimate -2**63", {"estimate__input_tokens": -(2**63)}),
        ("estimate 1.5", {"estimate__input_tokens": 1.5}),
        ("estimate as a word", {"estimate__input_tokens": "many"}),
        ("estimate as a list", {"estimate__input_tokens": [1]}),
        ("estimate null", {"estimate": None}),
        ("unknown estimate field", {"estimate__gpu_hours": 1}),
        ("estimate missing", {"estimate": ...}),
        ("request_id empty", {"request_id": ""}),
        ("request_id 201 chars", {"request_id": "r" * 201}),
        ("request_id a number", {"request_id": 12}),
        ("subject missing", {"subject": ...}),
        ("subject a string", {"subject": "acme"}),
        ("tenant empty", {"subject__tenant": ""}),
        ("tenant 201 chars", {"subject__tenant": "t" * 201}),
        ("tenant a number", {"subject__tenant": 7}),
        ("tenant null byte only allowed? (list)", {"subject__tenant": ["a"]}),
        ("unknown subject field", {"subject__org": "x"}),
        ("33 labels", {"subject__labels": {str(i): "v" for i in range(33)}}),
        ("nested label value", {"subject__labels": {"a": {"b": "c"}}}),
        ("unknown top-level field", {"extra": True}),
        ("subject missing the group_by field", {"subject": {"model": "m1"}}),
    ]:
        cases.append((what, "POST", "/v1/admit", {"json": _body(**changes)}))
    cases += [
        ("commit unknown reservation", "POST", "/v1/commit",
         {"json": {"reservation_id": "nope", "usage": {"input_tokens": 1}}}),
        ("commit negative usage", "POST", "/v1/commit",
         {"json": {"reservation_id": "nope", "usage": {"input_tokens": -5}}}),
        ("commit usage 2**63", "POST", "/v1/commit",
         {"json": {"reservation_id": "nope", "usage": {"input_tokens": 2**63}}}),
        ("release reservation_id empty", "POST", "/v1/release", {"json": {"reservation_id": ""}}),
        ("release reservation_id 10 kB", "POST", "/v1/release",
         {"json": {"reservation_id": "r" * 10_000}}),
        ("budgets unknown parameter", "GET", "/v1/budgets", {"params": {"tenant": "acme", "x": 1}}),
        ("budgets empty tenant", "GET", "/v1/budgets", {"params": {"tenant": ""}}),
        ("budgets tenant 201 chars", "GET", "/v1/budgets", {"params": {"tenant": "t" * 201}}),
        ("PUT on /v1/admit", "PUT", "/v1/admit", {"json": _body()}),
        ("unknown path", "POST", "/v1/admitt", {"json": _body()}),
    ]  # fmt: skip
    return cases


class TestMalformedHttp:
    async def test_every_malformed_request_is_a_4xx_with_a_reason_and_changes_nothing(
        self,
        services: Services,
        admission_procs: AdmissionProcs,
        policy_factory: PolicyFactory,
        key_prefix: str,
        topic_prefix: str,
        redis_sync: redis.Redis,
        fault_record: FaultRecord,
    ) -> None:
        policy = policy_factory(unit="input_tokens", limit=100_000, group_by=["tenant"])
        await write_policies(services.redis_url, key_prefix, policy)
        proc = admission_procs.start(
            kafka_bootstrap=services.kafka_bootstrap,
            redis_url=services.redis_url,
            topic_prefix=topic_prefix,
            redis_prefix=key_prefix,
        )
        cases = _http_cases()
        statuses: Counter[str] = Counter()
        bad: list[str] = []
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as http:
            first = await http.post("/v1/admit", json=_body())
            assert first.status_code == 200, first.text
            # Its reserve leaves the unpublished list once Kafka acked it (a write of the
            # admission's own, not of the malformed requests): wait for it first.
            rid = first.json()["reservation_id"]
            unpub = unpublished_reserves_key(key_prefix)
            deadline = time.monotonic() + 60
            while redis_sync.zscore(unpub, rid) is not None:
                assert time.monotonic() < deadline, "the first admit's reserve was never acked"
                await asyncio.sleep(0.1)
            before = snapshot(redis_sync, key_prefix)  # the script wrote before answering
            for what, method, path, kwargs in cases:
                fault_record.inputs.append(f"HTTP {method} {path}: {what}")
                try:
                    answer = await http.request(method, path, **kwargs)
                except httpx.HTTPError as exc:
                    bad.append(f"{what}: connection error {exc!r}")
                    continue
                statuses[str(answer.status_code)] += 1
                try:
                    error = answer.json()["error"]
                    ok = bool(error["code"]) and bool(error["message"])
                except (ValueError, KeyError, TypeError):
                    ok = False
                if not (400 <= answer.status_code < 500 and ok):
                    bad.append(f"{what}: {answer.status_code} {answer.text[:200]}")
            after = snapshot(redis_sync, key_prefix)
            changed = sorted(set(before) ^ set(after)) + sorted(
                k for k in set(before) & set(after) if before[k] != after[k]
            )
            still = await http.post("/v1/admit", json=_body())
            assert still.status_code == 200, still.text
        # The last valid admit's reserve event is published after everything the malformed
        # requests could have published (one FIFO publisher, one tenant, one partition):
        # once it is on the topic, anything else would be there too.
        last_rid = still.json()["reservation_id"]
        usage_topic = f"{topic_prefix}usage"
        deadline = time.monotonic() + 60
        published = await read_topic(services.kafka_bootstrap, usage_topic, 2)
        while not any(last_rid in v.decode() for v in published):
            assert time.monotonic() < deadline, "the last admit's reserve never published"
            published = await read_topic(services.kafka_bootstrap, usage_topic, 2)
        fault_record.add(
            requests_sent=len(cases),
            answers_by_status=dict(sorted(statuses.items())),
            not_a_4xx_with_reason=bad,
            redis_keys_changed=changed,
            events_published=len(published),
            valid_admits=2,
            server_alive_afterwards=still.status_code == 200 and proc.proc.poll() is None,
        )
        assert not bad
        assert not changed
        assert still.status_code == 200
        assert len(published) == 2  # the two valid admits' reserve events, nothing else
