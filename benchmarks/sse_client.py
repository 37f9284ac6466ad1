"""A lean HTTP/1.1 client for streamed responses, for benchmarks that must leave the CPU to what
they measure: one keep-alive connection, a POST, the body's chunks as they come (chunked or
content-length). A full client (httpx) spent about as much CPU per streamed token as the gateway
it measured, on the same cores."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.status = 0  # of the last response

    async def post(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) to `path`; the response body's pieces as they arrive, `status`
        set before the first."""
        reader, writer = await self._open()
        writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                     f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                     .encode() + body)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        self.status = int(head[0].split()[1])
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
        if headers.get("transfer-encoding") == "chunked":
            async for piece in _chunked(reader):
                yield piece
        else:
            yield await reader.readexactly(int(headers.get("content-length", "0")))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()  # the blank line after the last chunk
            return
        piece = await reader.readexactly(size + 2)
        yield piece[:-2]
