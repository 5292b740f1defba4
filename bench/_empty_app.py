"""Baseline server: a FastAPI app with one empty route, served like ``spendgate admission``."""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI


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


if __name__ == "__main__":
    # The same uvicorn settings as admission.server.serve.
    uvicorn.run(
        build(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False
    )
