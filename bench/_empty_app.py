"""Baseline servers on the same stack as ``spendgate admission`` (``uvicorn_options``).

``fastapi``: a FastAPI app with one empty route (the framework's cost included);
``asgi``: a bare ASGI callable answering ``{}`` (the server's cost alone).
"""

from __future__ import annotations

import sys
from typing import Any

import uvicorn
from fastapi import FastAPI

from spendgate.admission.server import uvicorn_options


def build() -> FastAPI:
    """One POST route answering ``{}`` without reading anything."""
    app = FastAPI()

    @app.post("/v1/admit")
    async def admit() -> dict[str, str]:
        return {}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


async def bare(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answer every HTTP request ``{}`` (the body is read, as the admit path reads it)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"2"), (b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": b"{}"})


if __name__ == "__main__":
    # The same uvicorn settings as admission.server.serve.
    kind = sys.argv[2] if len(sys.argv) > 2 else "fastapi"
    uvicorn.run(
        build() if kind == "fastapi" else bare,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        **uvicorn_options(),
    )
