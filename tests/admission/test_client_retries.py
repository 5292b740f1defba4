"""The client retries 5xx (503 ``outcome_unknown`` included) boundedly, honouring Retry-After;
it sends secret subject fields as key ids."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from spendgate.admission.client import AdmissionClient, AsyncAdmissionClient
from spendgate.admission.exceptions import AdmissionUnavailable
from spendgate.schemas.key_ids import KeyIds
from tests.fixtures.key_ids import TEST_SECRET, key_id

UNKNOWN = {"error": {"code": "outcome_unknown", "message": "no ack in time; retry is safe"}}


class Flaky:
    """Answers 503 (Retry-After ``retry_after``) ``failures`` times, then 202."""

    def __init__(self, failures: int, retry_after: str = "0.2") -> None:
        self.failures = failures
        self.retry_after = retry_after
        self.seen: list[tuple[float, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((time.monotonic(), request.content))
        if len(self.seen) <= self.failures:
            return httpx.Response(503, json=UNKNOWN, headers={"Retry-After": self.retry_after})
        return httpx.Response(202, json={"reservation_id": "r1"})

    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.seen, self.seen[1:], strict=False)]


class TestRetries:
    def test_sync_commit_retries_503s_honouring_retry_after(self) -> None:
        flaky = Flaky(failures=2)
        with AdmissionClient("http://adm", transport=httpx.MockTransport(flaky)) as client:
            client.commit("r1", {"input_tokens": 5})
        assert len(flaky.seen) == 3
        assert len({body for _, body in flaky.seen}) == 1  # the same call each time
        assert all(gap >= 0.2 for gap in flaky.gaps())

    async def test_async_release_retries_503s_honouring_retry_after(self) -> None:
        flaky = Flaky(failures=3)
        transport = httpx.MockTransport(flaky)
        async with AsyncAdmissionClient("http://adm", transport=transport) as client:
            await client.release("r1")
        assert len(flaky.seen) == 4
        assert all(gap >= 0.2 for gap in flaky.gaps())

    def test_attempts_are_bounded(self) -> None:
        flaky = Flaky(failures=100, retry_after="0")
        transport = httpx.MockTransport(flaky)
        with (
            AdmissionClient("http://adm", retries=4, backoff_s=0.001, transport=transport) as c,
            pytest.raises(AdmissionUnavailable, match="outcome_unknown"),
        ):
            c.commit("r1", {"input_tokens": 5})
        assert len(flaky.seen) == 5

    def test_a_long_retry_after_is_capped(self) -> None:
        flaky = Flaky(failures=1, retry_after="3600")
        transport = httpx.MockTransport(flaky)
        with AdmissionClient("http://adm", max_backoff_s=0.1, transport=transport) as client:
            client.release("r1")
        assert len(flaky.seen) == 2 and flaky.gaps()[0] < 1

    def test_backoff_grows_with_jitter_up_to_the_cap(self) -> None:
        client = AdmissionClient("http://adm", backoff_s=0.1, max_backoff_s=0.5)
        try:
            waits = [client._wait(n) for n in range(6)]
        finally:
            client.close()
        assert 0.05 <= waits[0] <= 0.1
        assert 0.1 <= waits[1] <= 0.2
        assert all(0.25 <= w <= 0.5 for w in waits[3:])


class Recorder:
    """Answers every admit ``allow`` and keeps the bodies it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"decision": "allow", "reservation_id": "r1"})


class TestKeyIds:
    """With the deployment's key ids, a raw API key never leaves the calling process."""

    SUBJECT = {"tenant": "acme", "api_key": "sk-live-raw-1", "model": "m", "labels": {"t": "x"}}

    def test_sync_admit_sends_the_key_id(self) -> None:
        seen = Recorder()
        keys = KeyIds(TEST_SECRET.encode())
        transport = httpx.MockTransport(seen)
        with AdmissionClient("http://adm", transport=transport, key_ids=keys) as client:
            client.admit(self.SUBJECT, {"input_tokens": 5}, request_id="q1")
        (body,) = seen.bodies
        assert body["subject"] == {**self.SUBJECT, "api_key": key_id("sk-live-raw-1")}
        assert "sk-live-raw-1" not in json.dumps(body)

    async def test_async_admit_sends_the_key_id(self) -> None:
        seen = Recorder()
        keys = KeyIds(TEST_SECRET.encode())
        transport = httpx.MockTransport(seen)
        async with AsyncAdmissionClient("http://adm", transport=transport, key_ids=keys) as c:
            await c.admit(self.SUBJECT, {"input_tokens": 5}, request_id="q1")
        (body,) = seen.bodies
        assert body["subject"]["api_key"] == key_id("sk-live-raw-1")
        assert body["subject"]["tenant"] == "acme"

    def test_without_key_ids_admission_is_sent_the_value(self) -> None:
        # Then admission makes the key id itself (tests/integration/test_no_raw_keys.py).
        seen = Recorder()
        with AdmissionClient("http://adm", transport=httpx.MockTransport(seen)) as client:
            client.admit(self.SUBJECT, {"input_tokens": 5}, request_id="q1")
        assert seen.bodies[0]["subject"]["api_key"] == "sk-live-raw-1"
