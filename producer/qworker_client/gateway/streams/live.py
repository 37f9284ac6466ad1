"""A streamed response sent from the hub's reads: each read's new entries of its jobs are framed
and written to the client in the hub's read loop (`put_nowait`), through a `BodySink`, so a chunk
wakes no task. The response's own task waits once, for the end of the stream.

Before, each read woke every stream's task (a future set, a task step, and the resumption of
the coroutines it held: the body loop, the frames generator, the reader and its mailbox) only to
frame the entries and call the server's `send`: with about one token a chunk, that was a cost
per token.

What the stream sends is what `streams.Framer` makes of the entries, piece by piece as before:
a read's frames of a job as one piece, the last job's end with the usage chunk and `[DONE]` (the
last piece of the body); when a job fails, its error frame, then the response's other jobs are
cancelled, then `[DONE]`.
"""

from __future__ import annotations

import asyncio

from starlette.types import Send

from qworker_client.gateway.metrics import Metrics, Timing
from qworker_client.gateway.streams.frames import Follow, Framer
from qworker_client.gateway.streams.hub import Item
from qworker_client.gateway.streams.reader import Batch, OutputReader
from qworker_client.gateway.streams.sink import BodySink
from qworker_client.gateway.streams.sse import DONE

_DONE = DONE.encode()


class LiveStream:
    def __init__(self, reader: OutputReader, follow: Follow, metrics: Metrics,
                 timing: Timing | None = None) -> None:
        self.reader = reader
        self.follow = follow
        self.metrics = metrics
        self.timing = timing
        self._framer = Framer(follow, metrics)
        self._sink: BodySink | None = None
        # set once the last piece is written: None, or the jobs to cancel (one failed)
        self._end: asyncio.Future[list[str] | None] | None = None

    @property
    def complete(self) -> bool:
        """Whether the last piece of the body has been written."""
        return self._sink is not None and self._sink.ended

    async def send(self, send: Send) -> None:
        """Write the stream's frames through `send` (the server's, the response started) as
        the reads bring them, until the last has gone; raises what failed the reads, or the
        OSError of a connection that broke."""
        end: asyncio.Future[list[str] | None] = asyncio.get_running_loop().create_future()
        sink = BodySink(send, self._failed)
        self._end, self._sink = end, sink
        self.metrics.open_streams += 1
        try:
            self.reader.push(self)
            failed = await end
            if failed is not None:
                await self.follow.cancel(failed)
                sink.write(_DONE, more=False)
            await sink.flushed()
            if self.timing is not None:
                self.timing.done()
        finally:
            self.reader.close()
            sink.cancel()
            self.metrics.open_streams -= 1

    def put_nowait(self, item: Item) -> None:
        """What a read brought one job (or the error that ended the reads): called by the hub."""
        if self._end is None or self._end.done():
            return  # its end is written: what comes after is not sent
        if isinstance(item, BaseException):
            self._failed(item)
            return
        try:
            batch = self.reader.batch(*item)
            if batch:
                self._write(batch)
        except Exception as exc:  # the hub's loop goes on for the other streams
            self._failed(exc)

    def _write(self, batch: Batch) -> None:
        assert self._sink is not None and self._end is not None
        parts: list[str] = []
        if self.timing is not None and batch:
            self.timing.first_chunk()
        if self._framer.add(batch, parts):  # a job failed: its error frame is the last part
            self._sink.write("".join(parts).encode())
            self._end.set_result(list(self.reader.open))
        elif not self.reader.open:  # every job has ended
            self._sink.write("".join(parts + self._framer.ending()).encode(), more=False)
            self._end.set_result(None)
        elif parts:
            self._sink.write("".join(parts).encode())

    def _failed(self, exc: BaseException) -> None:
        if self._end is not None and not self._end.done():
            self._end.set_exception(exc)
