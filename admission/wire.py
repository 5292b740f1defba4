"""HTTP on the wire for admission: error bodies, the body guard, raw ASGI JSON answers."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from spendgate.admission.exceptions import (
    AdmissionError,
    PayloadTooLarge,
    UnsupportedMediaType,
    Unvouched,
)

__all__ = [
    "BodyGuard",
    "encode_json",
    "error_content",
    "error_headers",
    "error_of",
    "guard_problem",
    "read_body",
    "replaying",
    "send_json",
]

#: JSON bytes of an answer's content (compact, UTF-8), for both entrances of the admit path.
encode_json = msgspec.json.Encoder().encode


def error_content(
    code: str,
    message: str,
    field: str | None = None,
    state: str | None = None,
) -> dict[str, Any]:
    """The body of every error answer: ``{error: {code, message, field?, state?}}``."""
    body: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        body["field"] = field
    if state is not None:
        body["state"] = state
    return {"error": body}


def error_headers(exc: AdmissionError) -> dict[str, str] | None:
    """The headers an admission error is answered with (auth challenge, Retry-After)."""
    if exc.status == 401:
        return {"WWW-Authenticate": "Bearer"}
    if exc.status == 503:
        return {"Retry-After": "1"}
    return None


def error_of(exc: AdmissionError) -> dict[str, Any]:
    """The body of an admission error."""
    state = exc.state if isinstance(exc, Unvouched) else None
    return error_content(exc.code, exc.message, exc.field, state)


async def send_json(
    send: Send, status: int, content: Any, headers: dict[str, str] | None = None
) -> None:
    """Answer with ``content`` as JSON, in two ASGI messages and one encode."""
    body = encode_json(content)
    raw = [
        (b"content-length", str(len(body)).encode()),
        (b"content-type", b"application/json"),
    ]
    if headers:
        raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def guard_problem(
    content_length: str, content_type: str, max_body_bytes: int
) -> AdmissionError | None:
    """Why a body is refused before it is read: too large (413) or not JSON (415)."""
    if content_length.isdigit() and int(content_length) > max_body_bytes:
        return PayloadTooLarge(f"body of {content_length} bytes is over {max_body_bytes}")
    if not _json_type(content_type):
        return UnsupportedMediaType("send the body as JSON with Content-Type: application/json")
    return None


async def read_body(receive: Receive, max_body_bytes: int) -> bytes | AdmissionError | None:
    """The whole body, a 413 when it grows over the bound, or None on disconnect."""
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    body: bytes = message.get("body", b"")
    more = message.get("more_body", False)
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > max_body_bytes:
            break
    if len(body) > max_body_bytes:
        return PayloadTooLarge(f"body is over {max_body_bytes} bytes")
    return body


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (already read) once, then defers to ``receive``."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class BodyGuard:
    """Refuse, before any parsing, bodies that are too large (413) or not JSON (415)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = guard_problem(
            headers.get("content-length", ""), headers.get("content-type", ""), self.max_body_bytes
        )
        if problem is None:
            body = await read_body(receive, self.max_body_bytes)
            if body is None:
                return
            if isinstance(body, bytes):
                await self.app(scope, replaying(body, receive), send)
                return
            problem = body
        await send_json(send, problem.status, error_of(problem))
