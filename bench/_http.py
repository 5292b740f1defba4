"""A minimal keep-alive HTTP/1.1 client for load generation (much cheaper per request than
httpx, so the load generator is less likely to be the bottleneck)."""

from __future__ import annotations

import asyncio


class Conn:
    """One keep-alive connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Conn:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        return cls(reader, writer)

    async def request(self, data: bytes) -> tuple[int, bytes]:
        """Send one full request; return (status, body)."""
        self.writer.write(data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        low = head.lower()
        i = low.find(b"content-length:")
        if i < 0:
            raise RuntimeError("response without content-length")
        n = int(low[i + 15 : low.index(b"\r\n", i)])
        body = await self.reader.readexactly(n) if n else b""
        return status, body

    def close(self) -> None:
        self.writer.close()


def post(path: str, body: bytes, host: str = "127.0.0.1") -> bytes:
    """The bytes of a JSON POST request."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def get(path: str, host: str = "127.0.0.1") -> bytes:
    """The bytes of a GET request."""
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
