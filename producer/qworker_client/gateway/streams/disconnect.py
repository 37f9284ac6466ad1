"""Work that stops when the client goes: a request's jobs are cancelled on a disconnect (unless
the request detached them), while they wait in the queue as much as while they stream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from starlette.types import Receive, Scope, Send

from qworker_client.gateway.streams.live import LiveStream
from qworker_client.gateway.streams.sse import DONE, HEADERS, MEDIA_TYPE

T = TypeVar("T")
Abort = Callable[[], Awaitable[None]]
# the server's own `send`, put in the scope by the app (`app.GatewayApp`): a stream's body pieces
# go straight to it, not through the send of each middleware (which only watch the response's
# start, still sent through them); nothing in the gateway rewrites a body
RAW_SEND = "qworker.raw_send"


async def until_disconnect(receive: Receive, work: Callable[[], Coroutine[Any, Any, T]],
                           on_abort: Abort, complete: Callable[[], bool] = lambda: False
                           ) -> T | None:
    """`work()`'s value, or None (after `on_abort()`) when the client disconnected first.
    `complete()`: whether the response has gone whole (uvicorn says "disconnect" once it has,
    which is then no client going, even while `work` is still finishing).

    `work` runs in a task of its own, awaited, which a watcher task (waiting for the disconnect)
    cancels; a cancel of the caller's task cancels it too. Not in the caller's task: the work
    of a response sent whole wakes once per read of its jobs, and each wake-up resumed every
    coroutine the task holds, in the request's task the server's, each middleware's and the
    router's (about 20), in its own only the work's few. anyio's task group would do this too,
    with its cancel scopes: about 5% of the gateway's CPU when streams ran this way."""
    loop = asyncio.get_running_loop()
    worker = loop.create_task(work())
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        if not worker.done() and not complete():
            gone = True
            worker.cancel()

    watcher = loop.create_task(watch())
    try:
        return await worker
    except asyncio.CancelledError:
        if not gone or _cancelling():
            raise  # the caller's task was cancelled (too)
    finally:
        watcher.cancel()
    with anyio.CancelScope(shield=True):
        await on_abort()
    return None


def _cancelling() -> bool:
    """Whether the current task has a cancel pending (Python 3.11+; before: never known)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


class EventStream:
    """An ASGI response sending server-sent events: the frames of `stream` as the reads bring
    them, or (no stream) only `[DONE]`; `on_abort` runs when the client left before the last
    frame (or sending failed)."""

    def __init__(self, stream: LiveStream | None, on_abort: Abort,
                 headers: dict[str, str] | None = None) -> None:
        self.stream = stream
        self.on_abort = on_abort
        self.headers = {**HEADERS, **(headers or {}), "content-type": MEDIA_TYPE}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        body_send: Send = scope.get(RAW_SEND, send)
        if self.stream is None:
            await body_send({"type": "http.response.body", "body": DONE.encode(),
                             "more_body": False})
            return
        stream = self.stream
        # the last piece goes from the hub's read, before this stream's task has seen it
        await until_disconnect(receive, lambda: self._send_all(body_send), self.on_abort,
                               lambda: stream.complete)

    async def _send_all(self, send: Send) -> bool:
        assert self.stream is not None
        try:
            await self.stream.send(send)
        except OSError:  # the connection broke under a send
            await self.on_abort()
            return False
        return True
