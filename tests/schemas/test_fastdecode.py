"""The fast decoder accepts and refuses exactly what ``parse_event`` does, with its errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from spendgate.schemas.events import parse_event
from spendgate.schemas.fastdecode import Event, _fast, decode, from_model


def view(event: Event) -> tuple[Any, ...]:
    """An event's content, whichever path built it."""
    subject = event.subject
    fields = ("tenant", "team", "project", "api_key", "user", "model", "env")
    usage = event.usage
    amounts = (
        None
        if usage is None
        else tuple(
            getattr(usage, f)
            for f in (
                "requests",
                "input_tokens",
                "cached_input_tokens",
                "output_tokens",
                "gpu_ms",
                "cost_usd_micros",
            )
        )
    )
    return (
        event.kind,
        event.event_id,
        tuple(subject.value(f) for f in fields),
        dict(subject.labels),
        event.occurred_ms,
        amounts,
        event.reservation_id,
        event.expires_ms,
    )


def same_as_the_models(raw: bytes) -> None:
    try:
        model = parse_event(raw)
    except ValidationError as exc:
        assert _fast(raw) is None
        with pytest.raises(ValidationError) as info:
            decode(raw)
        # The same error, hence the same dead-letter reason.
        assert str(info.value) == str(exc)
        return
    fast = _fast(raw)
    assert fast is None or view(fast) == view(from_model(model))
    assert view(decode(raw)) == view(from_model(model))


# Values that are valid somewhere, invalid elsewhere, or spelled in ways only one reader takes.
ODD = st.sampled_from(
    [None, True, 0, 1, -1, 5.0, 1.5, 1e2, 2**53 - 1, 2**53, 2**63, -(2**53), "", "x", "5",
     "t" * 200, "t" * 201, "\U0001f600" * 200, [], {}, {"a": 1}]
)  # fmt: skip
TIMES = st.one_of(
    st.from_regex(
        r"\A(19[0-9]{2}|20[0-9]{2}|0000|9999)-(0[0-9]|1[0-3])-([0-3][0-9])[Tt ]"
        r"([0-2][0-9]):([0-6][0-9])(:[0-6][0-9])?(\.[0-9]{1,9})?(Z|z|[+-](0[0-9]|2[0-5]):[0-5][0-9])?\Z"
    ),
    st.integers(-(10**12), 10**13),
    st.sampled_from(
        ["1970-01-01T00:00:00Z", "1969-12-31T23:59:59.999999Z", "2026-02-29T00:00:00Z"]
    ),
)  # fmt: skip
GOOD_TIMES = st.builds(
    lambda d, h, frac, off: f"2026-03-{d:02d}T{h:02d}:30:15{frac}{off}",
    st.integers(1, 31),
    st.integers(0, 23),
    st.sampled_from(["", ".1", ".123", ".123456", ".9999999"]),
    st.sampled_from(["Z", "+00:00", "-00:00", "+05:30", "-11:00", "+23:59"]),
)
BASE: dict[str, dict[str, Any]] = {
    "reserve": {"reservation_id": "r1", "usage": {"input_tokens": 5},
                "expires_at": "2026-03-31T23:59:59Z"},
    "commit": {"usage": {"input_tokens": 5, "output_tokens": 2}, "reservation_id": "r1"},
    "release": {"reservation_id": "r1"},
    "adjust": {"usage": {"input_tokens": -5}, "ref_event_id": "e0"},
}  # fmt: skip
PLACES = [("event_id",), ("kind",), ("schema_version",), ("occurred_at",), ("expires_at",),
          ("reservation_id",), ("ref_event_id",), ("usage",), ("subject",), ("extra",),
          ("subject", "tenant"), ("subject", "model"), ("subject", "org"), ("subject", "labels"),
          ("subject", "labels", "k"), ("usage", "requests"), ("usage", "cost_usd_micros"),
          ("usage", "gpu_ms"), ("usage", "tokens")]  # fmt: skip
DELETE = object()


@st.composite
def records(draw: st.DrawFn) -> bytes:
    """A valid event of each kind with up to three fields changed, added or removed."""
    kind = draw(st.sampled_from(list(BASE)))
    body: dict[str, Any] = {
        "event_id": "e1",
        "kind": kind,
        "subject": {"tenant": "a", "model": "m", "labels": {"k": "v"}},
        "occurred_at": draw(GOOD_TIMES),
        **json.loads(json.dumps(BASE[kind])),
    }
    for _ in range(draw(st.integers(0, 3))):
        *path, last = draw(st.sampled_from(PLACES))
        where = body
        for step in path:
            if not isinstance(where.get(step), dict):
                where[step] = {}
            where = where[step]
        value = draw(st.sampled_from([DELETE]) | ODD | TIMES | GOOD_TIMES)
        if value is DELETE:
            where.pop(last, None)
        else:
            where[last] = json.loads(json.dumps(value))  # a copy: the pools are shared
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    if draw(st.integers(0, 9)) == 0:  # a repeated key: the last one wins in both readers
        text = text[:-1] + ', "kind": ' + json.dumps(draw(st.sampled_from(list(BASE)))) + "}"
    return text.encode()


VALID = {
    "event_id": "e1",
    "kind": "reserve",
    "subject": {"tenant": "a", "model": "m", "labels": {"k": "v"}},
    "occurred_at": "2026-01-01T10:00:00.123456+01:00",
    "usage": {"input_tokens": 5, "cost_usd_micros": None},
    "reservation_id": "r1",
    "expires_at": "2026-01-01T10:00:00.123457+01:00",
}


class TestFastDecode:
    @given(raw=records())
    def test_it_agrees_with_the_models(self, raw: bytes) -> None:
        same_as_the_models(raw)

    @given(raw=st.binary(max_size=40))
    def test_it_agrees_on_any_bytes(self, raw: bytes) -> None:
        same_as_the_models(raw)

    @pytest.mark.parametrize(
        "raw",
        [
            b"",
            b"null",
            b"[1, 2, 3]",
            b'"commit"',
            b"\xef\xbb\xbf" + json.dumps(VALID).encode(),
            json.dumps(VALID).encode()[:-7],
            json.dumps({**VALID, "event_id": "XX"}).encode().replace(b'"XX"', b'"\xff\xfe"'),
            json.dumps({**VALID, "event_id": "XX"}).encode().replace(b'"XX"', b'"\\ud800"'),
            json.dumps({**VALID, "usage": {"input_tokens": 1.0}}).encode(),
            json.dumps({**VALID, "usage": {"input_tokens": 10**400}}).encode(),
            json.dumps({**VALID, "usage": {"input_tokens": True}}).encode(),
            json.dumps({**VALID, "occurred_at": 10**20}).encode(),
            json.dumps({**VALID, "occurred_at": 1_700_000_000}).encode(),
            json.dumps({**VALID, "expires_at": VALID["occurred_at"]}).encode(),
            json.dumps({**VALID, "subject": {"labels": {str(i): "v" for i in range(33)}}}).encode(),
            b"[" * 20_000 + b"]" * 20_000,
        ],
    )
    def test_the_bad_event_table_and_odd_spellings(self, raw: bytes) -> None:
        same_as_the_models(raw)

    def test_the_common_event_takes_the_fast_path(self) -> None:
        event = _fast(json.dumps(VALID).encode())
        assert event is not None
        assert view(event) == view(from_model(parse_event(json.dumps(VALID))))
        assert event.expires_ms == event.occurred_ms  # the same millisecond, floored
