"""Bearer tokens bound to tenants: 401, 403, and no reading or charging another tenant."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from spendgate.admission.auth import OPERATOR, Authorizer, load_tokens
from spendgate.schemas.exceptions import ConfigurationError
from tests.fixtures.admission import Admission, MakeAdmission
from tests.fixtures.factories import PolicyFactory
from tests.fixtures.services import Services

pytestmark = pytest.mark.integration

A = {"Authorization": "Bearer tok-a"}
B = {"Authorization": "Bearer tok-b"}
ALL = {"Authorization": "Bearer tok-all"}
OPS = {"Authorization": "Bearer tok-ops"}


@pytest.fixture
async def adm(make_admission: MakeAdmission, policy_factory: PolicyFactory) -> Admission:
    authorizer = Authorizer(
        {
            "tok-a": frozenset({"a"}),
            "tok-b": frozenset({"b"}),
            "tok-all": None,
            "tok-ops": OPERATOR,
        }
    )
    admission = await make_admission(authorizer=authorizer)
    await admission.policies(policy_factory(limit=1000, unit="input_tokens"))
    return admission


class TestAuth:
    @pytest.mark.parametrize(
        "headers",
        [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dG9rLWE="}],
    )
    async def test_missing_or_unknown_token_is_401(
        self, adm: Admission, headers: dict[str, str], caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.DEBUG)
        answer = await adm.admit("a", input_tokens=1, headers=headers)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "unauthorized"
        assert answer.headers["WWW-Authenticate"] == "Bearer"
        assert (
            await adm.http.get("/v1/budgets", params={"tenant": "a"}, headers=headers)
        ).status_code == 401
        assert "nope" not in caplog.text and "tok-a" not in caplog.text

    async def test_a_token_for_a_cannot_charge_or_read_b(self, adm: Admission) -> None:
        assert (await adm.admit("a", input_tokens=1, headers=A)).status_code == 200
        charge_b = await adm.admit("b", input_tokens=1, headers=A)
        assert charge_b.status_code == 403
        assert charge_b.json()["error"]["field"] == "subject.tenant"
        read_b = await adm.http.get("/v1/budgets", params={"tenant": "b"}, headers=A)
        assert read_b.status_code == 403 and read_b.json()["error"]["field"] == "tenant"
        no_tenant = await adm.admit("a", subject={"model": "m1"}, input_tokens=1, headers=A)
        assert no_tenant.status_code == 403

    async def test_settling_another_tenants_reservation_is_403(self, adm: Admission) -> None:
        rid = (await adm.admit("b", input_tokens=5, headers=B)).json()["reservation_id"]
        commit = await adm.http.post(
            "/v1/commit", json={"reservation_id": rid, "usage": {"input_tokens": 1}}, headers=A
        )
        release = await adm.http.post("/v1/release", json={"reservation_id": rid}, headers=A)
        assert commit.status_code == release.status_code == 403
        assert adm.publisher.kinds() == ["reserve"]  # type: ignore[attr-defined]
        ok = await adm.http.post("/v1/release", json={"reservation_id": rid}, headers=B)
        assert ok.status_code == 202

    async def test_star_token_acts_for_every_tenant(self, adm: Admission) -> None:
        assert (await adm.admit("b", input_tokens=1, headers=ALL)).status_code == 200
        got = await adm.http.get("/v1/budgets", params={"tenant": "zzz"}, headers=ALL)
        assert got.status_code == 200

    async def test_operator_token_reads_every_tenant_and_acts_for_none(
        self, adm: Admission
    ) -> None:
        for tenant in ("a", "b", "zzz"):
            got = await adm.http.get("/v1/budgets", params={"tenant": tenant}, headers=OPS)
            assert got.status_code == 200, got.text
        admit = await adm.admit("a", input_tokens=1, headers=OPS)
        assert admit.status_code == 403
        assert "read-only" in admit.json()["error"]["message"]
        rid = (await adm.admit("a", input_tokens=5, headers=A)).json()["reservation_id"]
        release = await adm.http.post("/v1/release", json={"reservation_id": rid}, headers=OPS)
        assert release.status_code == 403

    async def test_health_and_metrics_need_no_token(self, adm: Admission) -> None:
        assert (await adm.http.get("/healthz")).status_code == 200
        assert (await adm.http.get("/metrics")).status_code == 200


class TestTokensFile:
    def test_yaml_and_json_files(self, tmp_path: Path) -> None:
        yaml_file = tmp_path / "t.yaml"
        yaml_file.write_text('k1: [acme, beta]\nk2: "*"\nk4: operator\n')
        assert load_tokens(yaml_file) == {
            "k1": frozenset({"acme", "beta"}),
            "k2": None,
            "k4": "operator",
        }
        json_file = tmp_path / "t.json"
        json_file.write_text('{"k3": ["x"]}')
        assert load_tokens(json_file) == {"k3": frozenset({"x"})}

    @pytest.mark.parametrize("text", ["[a, b]", "secret-token: 5", "secret-token: [1]", ": ["])
    def test_bad_files_name_no_token(self, tmp_path: Path, text: str) -> None:
        path = tmp_path / "t.yaml"
        path.write_text(text)
        with pytest.raises(ConfigurationError) as caught:
            load_tokens(path)
        assert "secret-token" not in str(caught.value)


class TestTokensNeverLogged:
    async def test_a_real_server_at_debug_logs_no_token_nor_its_base64(
        self,
        services: Services,
        key_prefix: str,
        topic_prefix: str,
        policy_factory: PolicyFactory,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The product's server stack (uvicorn with ``uvicorn_options``, access log on) at
        DEBUG over TCP: requests that use a valid token, an unknown one and the token sent
        as Basic credentials; no log line holds a token or a base64 form of it."""
        import base64
        import threading
        import time

        import httpx
        import uvicorn

        from spendgate.admission.server import build_app, uvicorn_options
        from spendgate.admission.settings import AdmissionSettings
        from spendgate.streams.materialize import RedisMaterializer
        from tests.fixtures.admission import TOPOLOGY, VOUCHED, free_port

        good, unknown = "tok-live-a-7f3c9e", "tok-unknown-2b8d41"
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text(f"{good}: [a]\n")
        port = free_port()
        settings = AdmissionSettings(
            kafka_bootstrap=services.kafka_bootstrap,
            redis_url=services.redis_url,
            topic_prefix=topic_prefix,
            redis_prefix=key_prefix,
            admission_port=port,
            auth_tokens_file=tokens,
            policy_refresh_s=0.05,
        )
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(services.redis_url)
        await RedisMaterializer(client, key_prefix).stand_in(
            [policy_factory(limit=1000, unit="input_tokens")], TOPOLOGY, VOUCHED
        )
        await client.aclose()
        caplog.set_level(logging.DEBUG)  # every logger, the server's and the app's
        options = {**uvicorn_options(), "log_level": "debug", "access_log": True}
        # The request lines come from httpx's and uvicorn's loggers, which an earlier test
        # in this process may have quietened (importing litellm sets httpx's to WARNING),
        # disabled or stopped at their own handlers: let them reach caplog's.
        for name in ("httpx", "uvicorn", "uvicorn.access", "uvicorn.error"):
            caplog.set_level(logging.DEBUG, logger=name)
            monkeypatch.setattr(logging.getLogger(name), "disabled", False)
            monkeypatch.setattr(logging.getLogger(name), "propagate", True)
        server = uvicorn.Server(
            uvicorn.Config(build_app(settings), host="127.0.0.1", port=port, **options)
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while not server.started:
                assert time.monotonic() < deadline and thread.is_alive(), "no server"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # the policies are read
            body = {
                "request_id": "log-1",
                "subject": {"tenant": "a", "model": "m1"},
                "estimate": {"input_tokens": 1},
            }
            basic = base64.b64encode(f"user:{good}".encode()).decode()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                used = await http.post(
                    "/v1/admit", json=body, headers={"Authorization": f"Bearer {good}"}
                )
                assert used.status_code == 200, used.text
                budgets = await http.get(
                    "/v1/budgets",
                    params={"tenant": "a"},
                    headers={"Authorization": f"Bearer {good}"},
                )
                assert budgets.status_code == 200, budgets.text
                for header in (f"Bearer {unknown}", f"Basic {basic}", f"Bearer  {good}x"):
                    answer = await http.post(
                        "/v1/admit", json=body, headers={"Authorization": header}
                    )
                    assert answer.status_code == 401, (header, answer.text)
        finally:
            server.should_exit = True
            thread.join(timeout=20)
        text = caplog.text
        # The log is not empty: the access log saw the requests (so a leak would show).
        assert "/v1/admit" in text and "/v1/budgets" in text, text
        for token in (good, unknown):
            forms = {
                token,
                base64.b64encode(token.encode()).decode(),
                base64.b64encode(f"user:{token}".encode()).decode(),
                base64.b64encode(f"Bearer {token}".encode()).decode(),
            }
            for form in forms:
                assert form not in text, f"{form!r} is in the log"
