"""`sink.BodySink`: a piece the server's `send` takes at once is written before `write` returns
(no task); while a send waits (the client reads slowly), what is written meanwhile goes after it,
as one piece, in order, the body's end last; a cancel drops what waits; a failure after waiting
is reported, and raised by `flushed`."""

from __future__ import annotations

import asyncio

import pytest

from qworker_client.gateway.streams.sink import BodySink


class Server:
    """An ASGI `send` that waits while `paused` is set (as uvicorn's, for a paused transport)."""

    def __init__(self, fail: BaseException | None = None, yield_first: bool = False) -> None:
        self.written: list[tuple[bytes, bool]] = []
        self.resumed = asyncio.Event()
        self.paused = False
        self.cancelled = 0
        self.fail = fail
        self.yield_first = yield_first

    async def send(self, message: dict[str, object]) -> None:
        if self.yield_first:
            await asyncio.sleep(0)
        if self.paused:
            try:
                await self.resumed.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            if self.fail is not None:
                raise self.fail
        body, more = message["body"], message["more_body"]
        assert isinstance(body, bytes) and isinstance(more, bool)
        self.written.append((body, more))


def test_a_piece_taken_at_once_is_written_before_write_returns() -> None:
    async def run() -> None:
        server = Server()
        sink = BodySink(server.send, pytest.fail)
        tasks = len(asyncio.all_tasks())
        sink.write(b"a")
        sink.write(b"b", more=False)
        assert server.written == [(b"a", True), (b"b", False)]
        assert len(asyncio.all_tasks()) == tasks and sink.ended
        await sink.flushed()

    asyncio.run(run())


@pytest.mark.parametrize("yield_first", [False, True], ids=["future", "bare-yield"])
def test_what_is_written_while_a_send_waits_goes_after_it_together(yield_first: bool) -> None:
    async def run() -> list[tuple[bytes, bool]]:
        server = Server(yield_first=yield_first)
        server.paused = True
        sink = BodySink(server.send, pytest.fail)
        sink.write(b"a")
        sink.write(b"b")
        sink.write(b"c", more=False)
        await asyncio.sleep(0.01)
        assert server.written == []
        server.paused = False
        server.resumed.set()
        await sink.flushed()
        return server.written

    assert asyncio.run(run()) == [(b"a", True), (b"bc", False)]


def test_a_cancel_drops_what_waits() -> None:
    async def run() -> tuple[list[tuple[bytes, bool]], int]:
        server = Server()
        server.paused = True
        sink = BodySink(server.send, pytest.fail)
        sink.write(b"a")
        sink.write(b"b")
        await asyncio.sleep(0.01)
        sink.cancel()
        await asyncio.sleep(0.01)
        server.resumed.set()
        await asyncio.sleep(0.01)
        return server.written, server.cancelled

    assert asyncio.run(run()) == ([], 1)


def test_a_send_that_fails_after_waiting_is_reported_and_raised() -> None:
    async def run() -> list[BaseException]:
        server = Server(fail=OSError("broken pipe"))
        server.paused = True
        failed: list[BaseException] = []
        sink = BodySink(server.send, failed.append)
        sink.write(b"a")
        server.resumed.set()
        with pytest.raises(OSError, match="broken pipe"):
            await sink.flushed()
        return failed

    failed = asyncio.run(run())
    assert len(failed) == 1 and isinstance(failed[0], OSError)
