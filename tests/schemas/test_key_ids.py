"""Key ids: the keyed hash of secret subject values, and where it replaces them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spendgate.schemas.events import Subject
from spendgate.schemas.exceptions import ConfigurationError, PolicyError
from spendgate.schemas.fastdecode import decode
from spendgate.schemas.key_ids import BUILT_IN_SECRET, KeyIds, secret_fields
from spendgate.schemas.key_settings import SubjectSecretSettings
from spendgate.schemas.policies import Policy
from tests.fixtures.key_ids import key_id

SECRET = b"0123456789abcdef-test-secret"
KEYS = KeyIds(SECRET)


def expected_id(secret: bytes, field: str, value: str) -> str:
    return key_id(value, field, secret)


def policy(**fields: object) -> Policy:
    return Policy.model_validate({"id": "p", "unit": "requests", "limit": 5, **fields})


def test_a_key_id_is_the_truncated_hmac_of_field_and_value() -> None:
    got = KEYS.of("sk-live-123")
    assert got == expected_id(SECRET, "api_key", "sk-live-123")
    assert re.fullmatch(r"sgk_[0-9a-f]{4}_[0-9a-f]{24}", got)
    assert KEYS.of("sk-live-123", "user") == expected_id(SECRET, "user", "sk-live-123")
    assert KEYS.of("sk-live-123", "user") != got


def test_another_secret_gives_other_ids_and_another_fingerprint() -> None:
    other = KeyIds(b"another secret, 16+ bytes long")
    assert other.of("k") != KEYS.of("k")
    assert other.fingerprint != KEYS.fingerprint
    assert KEYS.foreign(other.of("k")) and not KEYS.is_id(other.of("k"))
    assert KEYS.is_id(KEYS.of("k")) and not KEYS.foreign(KEYS.of("k"))


def test_a_key_id_passes_every_edge_unchanged_but_a_lookalike_is_hashed() -> None:
    kid = KEYS.of("sk-1")
    assert KEYS.of(kid) == kid
    assert KeyIds(b"another secret, 16+ bytes long").of(kid) == kid
    lookalike = "sgk_not-an-id"
    assert KEYS.of(lookalike) == expected_id(SECRET, "api_key", lookalike)


def test_subject_replaces_only_the_secret_fields() -> None:
    keys = KeyIds(SECRET, ("api_key", "user", "labels.card"))
    subject = Subject(
        tenant="acme",
        api_key="sk-1",
        user="u@example.com",
        model="m",
        labels={"card": "4111", "team": "x"},
    )
    hidden = keys.subject(subject)
    assert hidden.tenant == "acme" and hidden.model == "m"
    assert hidden.api_key == expected_id(SECRET, "api_key", "sk-1")
    assert hidden.user == expected_id(SECRET, "user", "u@example.com")
    assert hidden.labels == {"card": expected_id(SECRET, "labels.card", "4111"), "team": "x"}
    assert keys.subject(hidden) is hidden
    plain = Subject(tenant="acme", model="m")
    assert keys.subject(plain) is plain


def test_subject_of_a_fast_decoded_record() -> None:
    raw = json.dumps(
        {
            "event_id": "e1",
            "kind": "commit",
            "subject": {"tenant": "acme", "api_key": "sk-1"},
            "occurred_at": "2026-01-01T00:00:00Z",
            "usage": {"requests": 1},
        }
    ).encode()
    subject = decode(raw).subject
    hidden = KEYS.subject(subject)
    assert type(hidden) is type(subject)
    assert hidden.api_key == expected_id(SECRET, "api_key", "sk-1")
    assert hidden.tenant == "acme"


values = st.text(min_size=1, max_size=60)


@given(api_key=values, user=values, label=values)
def test_no_raw_secret_survives_and_replacing_twice_changes_nothing(
    api_key: str, user: str, label: str
) -> None:
    keys = KeyIds(SECRET, ("api_key", "user", "labels.l"))
    hidden = keys.subject(Subject(api_key=api_key, user=user, labels={"l": label}))
    for field, value in (("api_key", api_key), ("user", user), ("labels.l", label)):
        got = hidden.value(field)
        assert got is not None
        assert (
            got == value
            if re.fullmatch(r"sgk_[0-9a-f]{4}_[0-9a-f]{24}", value)
            else (got == expected_id(SECRET, field, value))
        )
    assert keys.subject(hidden) is hidden


def test_policy_exact_values_become_key_ids_and_star_stays() -> None:
    got = KEYS.policy(policy(match={"api_key": "sk-1", "model": "claude-*"}))
    assert got.match == {"api_key": expected_id(SECRET, "api_key", "sk-1"), "model": "claude-*"}
    assert KEYS.policy(got) is got
    star = policy(match={"api_key": "*"})
    assert KEYS.policy(star) is star
    grouped = policy(group_by=["api_key"])
    assert KEYS.policy(grouped) is grouped


@pytest.mark.parametrize("pattern", ["sk-live-*", "sk-?", "sk-[ab]"])
def test_a_glob_on_a_secret_field_is_refused_without_repeating_it(pattern: str) -> None:
    with pytest.raises(PolicyError) as caught:
        KEYS.policy(policy(match={"api_key": pattern}))
    message = str(caught.value)
    assert "match.api_key" in message and "glob" in message
    assert pattern not in message


def test_a_key_id_of_another_secret_in_a_policy_is_refused() -> None:
    other = KeyIds(b"another deployment's secret!!").of("sk-1")
    with pytest.raises(PolicyError, match=r"match\.api_key: a key id made with another"):
        KEYS.policy(policy(match={"api_key": other}))
    own = KEYS.of("sk-1")
    assert KEYS.policy(policy(match={"api_key": own})).match["api_key"] == own


def test_a_lone_surrogate_has_a_key_id_and_its_record_is_redacted() -> None:
    # JSON allows "\ud800"; the models refuse the record, its dead letter must not crash.
    assert KEYS.of("\ud800") == expected_id(SECRET, "api_key", "\ud800")
    raw = b'{"kind":"x","subject":{"api_key":"\\ud800sk-raw"}}'
    hidden = KEYS.record(raw)
    assert json.loads(hidden)["subject"]["api_key"] == KEYS.of("\ud800sk-raw")


def test_record_bytes_for_a_dead_letter_hide_the_secret() -> None:
    keys = KeyIds(SECRET, ("api_key", "labels.card"))
    raw = json.dumps(
        {"kind": "bogus", "subject": {"api_key": "sk-raw", "labels": {"card": "4111"}}}
    ).encode()
    hidden = keys.record(raw)
    assert b"sk-raw" not in hidden and b"4111" not in hidden
    doc = json.loads(hidden)
    assert doc["kind"] == "bogus"
    assert doc["subject"]["api_key"] == expected_id(SECRET, "api_key", "sk-raw")
    assert keys.record(hidden) == hidden
    too_deep = b"[" * 100_000 + b"]" * 100_000
    for opaque in (b"not json sk-raw", b"[1,2]", b'{"subject": "sk-raw"}', too_deep):
        assert keys.record(opaque) == opaque


def test_secret_fields_parse_and_refuse() -> None:
    assert secret_fields("api_key, user,labels.card,api_key") == ("api_key", "user", "labels.card")
    assert secret_fields("") == ()
    for bad in ("tenant", "model", "pool", "secret", "labels."):
        with pytest.raises(ConfigurationError, match="SPENDGATE_SECRET_FIELDS"):
            secret_fields(bad)


def test_settings_without_a_secret_use_the_public_built_in_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPENDGATE_SUBJECT_SECRET")
    keys = SubjectSecretSettings().key_ids()
    assert keys.built_in and keys.fields == ("api_key",)
    assert keys.of("k") == expected_id(BUILT_IN_SECRET, "api_key", "k")


def test_settings_read_a_private_secret_file_and_refuse_a_shared_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPENDGATE_SUBJECT_SECRET")
    path = tmp_path / "subject.secret"
    path.write_bytes(SECRET + b"\n")
    # Private to its owner, or readable by its group too (a Kubernetes Secret volume).
    for mode in (0o600, 0o400, 0o640, 0o440):
        path.chmod(mode)
        keys = SubjectSecretSettings(
            subject_secret_file=path, secret_fields="api_key,user"
        ).key_ids()
        assert not keys.built_in and keys.fields == ("api_key", "user")
        assert keys.of("k") == expected_id(SECRET, "api_key", "k")
    for mode in (0o644, 0o666, 0o604, 0o660, 0o620):
        path.chmod(mode)
        with pytest.raises(ConfigurationError, match=f"chmod 600 {re.escape(str(path))}"):
            SubjectSecretSettings(subject_secret_file=path).key_ids()


def test_settings_refuse_a_short_secret_both_sources_and_a_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPENDGATE_SUBJECT_SECRET", "short")
    with pytest.raises(ConfigurationError, match="at least 16 bytes") as caught:
        SubjectSecretSettings().key_ids()
    assert "short" not in str(caught.value)
    monkeypatch.setenv("SPENDGATE_SUBJECT_SECRET", SECRET.decode())
    assert SubjectSecretSettings().key_ids().of("k") == expected_id(SECRET, "api_key", "k")
    path = tmp_path / "s"
    path.write_bytes(SECRET)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigurationError, match="not both"):
        SubjectSecretSettings(subject_secret_file=path).key_ids()
    monkeypatch.delenv("SPENDGATE_SUBJECT_SECRET")
    with pytest.raises(ConfigurationError, match="cannot read"):
        SubjectSecretSettings(subject_secret_file=tmp_path / "missing").key_ids()


def test_the_secret_never_shows_in_the_settings_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPENDGATE_SUBJECT_SECRET", SECRET.decode())
    settings = SubjectSecretSettings()
    assert SECRET.decode() not in repr(settings) and SECRET.decode() not in repr(settings.key_ids())
