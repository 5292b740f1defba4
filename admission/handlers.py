"""How the admission app answers what goes wrong: every error as ``{error: {code, message}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from spendgate.admission.exceptions import AdmissionError
from spendgate.admission.wire import error_content, error_headers, error_of

__all__ = ["error_response", "install_handlers"]

logger = logging.getLogger(__name__)


def error_response(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
    state: str | None = None,
) -> JSONResponse:
    """An error answer: ``{error: {code, message, field?, state?}}``."""
    return JSONResponse(
        error_content(code, message, field, state), status_code=status, headers=headers
    )


async def invalid_request(_: Request, exc: Exception) -> JSONResponse:
    """A body or query the framework could not validate: 400, naming the field."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return error_response(400, "invalid_json", f"body is not valid JSON: {first['msg']}")
    loc = [str(p) for p in first["loc"] if p not in ("body", "query")]
    field = ".".join(loc) or None
    return error_response(400, "invalid_request", f"{field or 'body'}: {first['msg']}", field)


async def admission_error(_: Request, exc: Exception) -> JSONResponse:
    """An :class:`AdmissionError`: its status, body and headers (as the admit fast path)."""
    assert isinstance(exc, AdmissionError)
    return JSONResponse(error_of(exc), exc.status, error_headers(exc))


async def http_error(_: Request, exc: Exception) -> JSONResponse:
    """The framework's own refusals (404, 405 ...) in the admission error shape."""
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers) if exc.headers else None
    return error_response(exc.status_code, code, str(exc.detail), headers=headers)


async def internal_error(_: Request, exc: Exception) -> JSONResponse:
    """Anything else: logged with its traceback, answered 500 without details."""
    logger.exception("internal error")
    return error_response(500, "internal", "internal error")


def install_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the admission error shape."""
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(AdmissionError, admission_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
