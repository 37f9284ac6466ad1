"""The gateway's HTTP server: uvicorn, with what a server facing clients that never finish their
request (slowloris) needs and uvicorn lacks, so idle connections cannot take every file
descriptor and shut the others out:

- a request's line and headers must have come `header_timeout_s` after the connection was made,
  or after the previous response (uvicorn has no such timeout: its keep-alive timer, the
  `keep_alive_s` an idle connection is kept, stops at the first byte of a request);
- they may be at most `max_header_bytes` (431; h11's `h11_max_incomplete_event_size` is set too,
  for when uvicorn runs on h11, but httptools has no bound of its own);
- at most `max_connections` connections at once: past it, the one that has waited for a request
  longest is closed (none waits: the new one gets a 503), so a new client is served at once and
  the gateway never runs out of file descriptors. By default that is the open-file limit less
  what the gateway keeps for its Redis connections and files.

Those are kept by `guarded_protocol`, uvicorn's own HTTP protocol with a few methods around it,
handed to uvicorn as its `http` setting: it knows when a request is under way (`cycle`)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from qworker_client.gateway.config import GatewayConfig, base_url
from qworker_client.gateway.connection import MAX_CONNECTIONS as MAX_REDIS_CONNECTIONS

FILES_RESERVE = 64  # descriptors kept for the listening socket, batches' Redis clients, files
_HEADERS_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
                      b"connection: close\r\n\r\n")
_NO_ROOM = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def uvicorn_config(app: ASGIApp, config: GatewayConfig, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
        http=guarded_protocol(config), timeout_keep_alive=config.keep_alive_s,
        h11_max_incomplete_event_size=config.max_header_bytes)


READY = "qworker gateway: ready, OpenAI base URL {url}"


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server that prints one line with its OpenAI base URL once it listens."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(READY.format(url=base_url(self.config.host, self._port())), flush=True)

    def _port(self) -> int:
        """The port it listens on (the one the system chose for port 0)."""
        for server in self.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return int(self.config.port)


def default_max_connections() -> int:
    """The open-file limit less the gateway's Redis connections and `FILES_RESERVE`."""
    try:
        import resource
    except ImportError:  # not on POSIX: no limit to keep under
        return 1 << 20
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(soft - MAX_REDIS_CONNECTIONS - FILES_RESERVE, 16)


def guarded_protocol(config: GatewayConfig) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools', else h11's) under the limits of `config`."""
    base: type[asyncio.Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    limits = {"header_timeout_s": config.header_timeout_s,
              "max_header_bytes": config.max_header_bytes,
              "max_connections": config.max_connections or default_max_connections()}
    return type("GuardedHttp", (_Guard, base), limits)


class _Guard(asyncio.Protocol):
    """Put before uvicorn's protocol class; its attributes (`cycle`, `transport`,
    `connections`, `loop`) are uvicorn's."""

    header_timeout_s: float
    max_header_bytes: int
    max_connections: int
    cycle: Any  # the request under way (or the last one), None before the first
    transport: asyncio.Transport
    connections: set[Any]  # every connection of the server
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._wait_begins()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting():  # no request yet: what came is (part of) its line and headers
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
                self._refuse(_HEADERS_TOO_LARGE)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._wait_begins()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        """Whether no request is under way: the next one's headers are awaited."""
        return self.cycle is None or self.cycle.response_complete

    def _wait_begins(self) -> None:
        self.waiting_since = self.loop.time()
        self._head_bytes = 0
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._headers_due)

    def _headers_due(self) -> None:
        self._deadline = None
        if self._waiting() and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        """Past `max_connections`, close the connection that has waited longest for a request;
        if none waits, refuse this one."""
        if len(self.connections) <= self.max_connections:
            return
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) <= self.max_connections:
            return
        waiting = [c for c in open_ if c is not self and isinstance(c, _Guard) and c._waiting()]
        if waiting:
            min(waiting, key=lambda c: c.waiting_since).transport.close()
        else:
            self._refuse(_NO_ROOM)

    def _refuse(self, response: bytes) -> None:
        self.transport.write(response)
        self.transport.close()
