"""Admission's publisher against a broker that accepts connections and never answers: every
answer comes within its stated bound, by the policy's failure mode, and nothing waits for
ever, neither the start nor the shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from spendgate.admission.publisher import KafkaPublisher
from spendgate.schemas.events import CommitEvent, Subject, Usage
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.schemas.policies import Policy
from spendgate.streams.materialize import RedisMaterializer
from tests.fixtures.admission import TOPOLOGY, VOUCHED, free_port
from tests.fixtures.blackhole import BlackHole, running
from tests.fixtures.dashboard import Process, wait_for
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.services import Services

#: SPENDGATE_ACK_TIMEOUT_S and SPENDGATE_SHUTDOWN_PUBLISH_S of these tests.
ACK_S = 0.5
SHUTDOWN_S = 1.0
#: The start checks' wait for Kafka: ``spendgate admission`` opens one connection before
#: serving (``check_connections``, 5 s) and the app's start again (``kafka_connect.check``,
#: 5 s): a broker that never answers holds the start for both (README, Publishing).
START_CHECKS_S = 2 * 5.0
#: What a Python process takes to import spendgate and reach Redis, on a loaded CI box.
SLACK_S = 5.0


def _commit() -> CommitEvent:
    rid = uuid.uuid4().hex
    return CommitEvent(
        event_id=f"commit-{rid}",
        subject=Subject(tenant="acme", model="m1"),
        occurred_at=datetime.now(UTC),
        reservation_id=rid,
        usage=Usage(input_tokens=1),
    )


class TestKafkaPublisher:
    @pytest.mark.parametrize("reads", [True, False], ids=["silent", "deaf"])
    async def test_an_ack_wait_and_the_shutdown_end_within_their_bounds(self, reads: bool) -> None:
        with running(reads=reads) as hole:
            pub = KafkaPublisher(
                KafkaConnection(bootstrap=hole.bootstrap),
                "blackhole.usage",
                10,
                ack_timeout_s=ACK_S,
                shutdown_s=SHUTDOWN_S,
            )
            async with pub:
                started = time.monotonic()
                assert not await pub.publish_acked(_commit())
                waited = time.monotonic() - started
                assert hole.accepted >= 1  # the producer reached it, and it never answered
                assert not pub.connected and pub.depth == 1
                closing = time.monotonic()
            closed = time.monotonic() - closing
        print(f"ack wait {waited:.2f} s, shutdown {closed:.2f} s")
        assert ACK_S <= waited < ACK_S + 0.5
        # The unacked commit keeps the drain waiting its whole bound; the producer, still
        # starting (its first request unanswered), is then cancelled at once.
        assert SHUTDOWN_S <= closed < SHUTDOWN_S + 1.0


async def _stand_in(redis_url: str, prefix: str, policies: list[Policy]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await RedisMaterializer(client, prefix).stand_in(policies, TOPOLOGY, VOUCHED)
    finally:
        await client.aclose()


def _timed(call: httpx.Client, path: str, body: dict[str, object]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = call.post(path, json=body)
    return answer, time.monotonic() - started


@pytest.mark.integration
class TestAdmissionProcess:
    def test_start_answers_and_sigterm_against_a_black_hole_are_bounded(
        self,
        services: Services,
        key_prefix: str,
        redis_sync: redis.Redis,
        blackhole: BlackHole,
        policy_factory: PolicyFactory,
        tmp_path: Path,
    ) -> None:
        closed = policy_factory(id="bh-closed", unit="requests", failure="closed",
                                match={"env": "c"})  # fmt: skip
        opened = policy_factory(id="bh-open", unit="requests", failure="open", match={"env": "o"})
        asyncio.run(_stand_in(services.redis_url, key_prefix, [closed, opened]))
        port = free_port()
        env = {
            **os.environ,
            "SPENDGATE_KAFKA_BOOTSTRAP": blackhole.bootstrap,
            "SPENDGATE_REDIS_URL": services.redis_url,
            "SPENDGATE_REDIS_PREFIX": key_prefix,
            "SPENDGATE_ADMISSION_PORT": str(port),
            "SPENDGATE_POLICY_REFRESH_S": "0.05",
            "SPENDGATE_REDIS_TIMEOUT_S": "5.0",
            # Room for one admit's reserve and one commit: then the buffer is full.
            "SPENDGATE_PUBLISH_BUFFER": "2",
            "SPENDGATE_ACK_TIMEOUT_S": str(ACK_S),
            "SPENDGATE_SHUTDOWN_PUBLISH_S": str(SHUTDOWN_S),
        }
        url = f"http://127.0.0.1:{port}"
        log = tmp_path / "admission.log"
        started = time.monotonic()
        adm = Process(["admission"], env, log)
        try:
            wait_for("admission", lambda: adm.answers(url + "/readyz"), START_CHECKS_S + 30)
            start_s = time.monotonic() - started
            assert blackhole.accepted >= 1
            with httpx.Client(base_url=url, timeout=30) as http:

                def admit(env_: str) -> tuple[httpx.Response, float]:
                    subject = {"tenant": "acme", "model": "m1", "env": env_}
                    body = {"request_id": uuid.uuid4().hex, "subject": subject,
                            "estimate": {"requests": 1}}  # fmt: skip
                    return _timed(http, "/v1/admit", body)

                first, first_s = admit("c")  # its reserve is queued: an admit never waits
                rid = first.json()["reservation_id"]
                commit, commit_s = _timed(
                    http, "/v1/commit", {"reservation_id": rid, "usage": {"requests": 1}}
                )
                refused, refused_s = admit("c")  # the buffer is full: closed answers 503
                admitted, admitted_s = admit("o")  # open admits (and counts it)
            stopping = time.monotonic()
            adm.proc.send_signal(signal.SIGTERM)
            adm.proc.wait(timeout=SHUTDOWN_S + 30)
            stop_s = time.monotonic() - stopping
        finally:
            adm.stop()
        print(
            f"start {start_s:.2f} s, admit {first_s:.3f} s, commit {commit_s:.2f} s, "
            f"refused {refused_s:.3f} s, open {admitted_s:.3f} s, SIGTERM {stop_s:.2f} s"
        )
        text = log.read_text()
        assert start_s < START_CHECKS_S + SLACK_S, text
        assert first.status_code == 200 and first_s < 1.0
        assert commit.status_code == 503 and commit.json()["error"]["code"] == "outcome_unknown"
        assert ACK_S <= commit_s < ACK_S + 1.0
        assert refused.status_code == 503 and refused_s < 1.0
        assert refused.json()["error"]["code"] == "publish_unavailable"
        assert admitted.status_code == 200 and admitted_s < 1.0
        assert stop_s < SHUTDOWN_S + 3.0, text
        assert "2 events were not acknowledged by Kafka before shutdown" in text
        assert "Traceback" not in text
