"""A response body written piece by piece through the ASGI server's `send`, from plain (not
async) code: the hub's read loop writes each stream's chunk of a read itself, with no task
woken per chunk.

The server's `send` is awaitable, but uvicorn's (httptools and h11) writes to its transport
and returns without suspending unless the transport asked it to pause: so each piece's `send`
is run by hand, and what finishes at once (nearly every piece) costs no task, no future and no
event-loop turn. A `send` that does suspend (the client reads slower than the stream goes) is
finished in a task, and the pieces written meanwhile wait behind it, then go out together as one
piece, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

from starlette.types import Send


class BodySink:
    def __init__(self, send: Send, on_error: Callable[[BaseException], None]) -> None:
        """`send`: the server's, once the response has started; `on_error`: told of a piece
        that failed once it was left to a task (one that fails at once raises from `write`)."""
        self._send = send
        self._on_error = on_error
        self._queued: list[bytes] = []  # written while a send was suspended
        self._queued_more = True
        self._task: asyncio.Task[None] | None = None  # finishing a suspended send
        self.error: BaseException | None = None
        self.ended = False  # the last piece (more_body false) was written

    def write(self, body: bytes, more: bool = True) -> None:
        """Send `body` (the last piece of the body unless `more`), now when the server can."""
        assert not self.ended, "the body has ended"
        self.ended = not more
        if self._task is not None:
            self._queued.append(body)
            self._queued_more = more
            return
        steps = self._send({"type": "http.response.body", "body": body,
                            "more_body": more}).__await__()
        try:
            waiting = steps.send(None)
        except StopIteration:
            return
        self._task = asyncio.get_running_loop().create_task(self._finish(steps, waiting))

    async def flushed(self) -> None:
        """Wait until every piece written so far has gone to the server; raises what failed."""
        if self._task is not None:
            await self._task
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Drop what is still waiting to go (the client went, or the response was given up)."""
        self._queued = []
        if self._task is not None:
            self._task.cancel()

    async def _finish(self, steps: Generator[Any, None, Any], waiting: object) -> None:
        try:
            await resume(steps, waiting)
            while self._queued:
                body, more, self._queued = b"".join(self._queued), self._queued_more, []
                await self._send({"type": "http.response.body", "body": body, "more_body": more})
        except Exception as exc:
            self.error = exc
            self._on_error(exc)
        finally:
            self._task = None


async def resume(steps: Generator[Any, None, Any], waiting: object) -> None:
    """Run to its end an awaitable driven by hand (`steps`, its `__await__()`) that suspended,
    yielding `waiting` (what asyncio code yields: the future it waits for, or None to let the
    loop turn), as a task would: resumed once that future is done. A cancel of this task cancels
    that future (the awaitable sees it there), or is thrown in where it let the loop turn."""
    while True:
        future: asyncio.Future[Any] | None = waiting if asyncio.isfuture(waiting) else None
        assert future is not None or waiting is None, waiting
        thrown = False
        try:
            if future is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait((future,))
        except asyncio.CancelledError:
            if future is None:
                thrown = True
            else:
                future.cancel()
        try:
            waiting = steps.throw(asyncio.CancelledError()) if thrown else steps.send(None)
        except StopIteration:
            return
