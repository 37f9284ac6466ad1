"""`disconnect.until_disconnect`: the work's value, or its cancel and the abort when the client
goes first; never an abort for a client that goes after the work is done (uvicorn's `receive`
says "disconnect" once a response is complete)."""

from __future__ import annotations

import asyncio

import pytest

from qworker_client.gateway.streams.disconnect import until_disconnect


class Client:
    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.aborts = 0

    async def receive(self) -> dict[str, object]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def abort(self) -> None:
        self.aborts += 1


def test_the_value_of_work_done_before_the_client_goes() -> None:
    async def run() -> tuple[object, int]:
        client = Client()

        async def work() -> str:
            client.gone.set()  # the response's end: the watcher hears "disconnect" next
            return "done"

        value = await until_disconnect(client.receive, work, client.abort)
        await asyncio.sleep(0.01)
        return value, client.aborts

    assert asyncio.run(run()) == ("done", 0)


def test_a_client_gone_first_cancels_the_work_and_aborts() -> None:
    async def run() -> tuple[object, int, bool]:
        client = Client()
        cancelled = False

        async def work() -> str:
            nonlocal cancelled
            try:
                client.gone.set()
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled = True
                raise
            return "never"

        value = await until_disconnect(client.receive, work, client.abort)
        return value, client.aborts, cancelled

    assert asyncio.run(run()) == (None, 1, True)


def test_a_cancel_of_the_caller_cancels_the_work_and_goes_on() -> None:
    async def run() -> tuple[bool, int]:
        client = Client()
        cancelled = False

        async def work() -> None:
            nonlocal cancelled
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled = True
                raise

        caller = asyncio.create_task(until_disconnect(client.receive, work, client.abort))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        return cancelled, client.aborts

    assert asyncio.run(run()) == (True, 0)


def test_an_error_of_the_work_is_the_callers() -> None:
    async def run() -> None:
        client = Client()

        async def work() -> None:
            raise ValueError("bad job")

        await until_disconnect(client.receive, work, client.abort)

    with pytest.raises(ValueError, match="bad job"):
        asyncio.run(run())


def test_a_disconnect_once_the_response_is_complete_is_no_abort() -> None:
    """The last piece of a stream goes from the hub's read: uvicorn says "disconnect" before the
    stream's own task has woken to finish."""
    async def run() -> tuple[object, int]:
        client = Client()
        sent = False

        async def work() -> str:
            nonlocal sent
            sent = True
            client.gone.set()
            await asyncio.sleep(0.01)  # still finishing when the watcher hears it
            return "done"

        value = await until_disconnect(client.receive, work, client.abort, lambda: sent)
        return value, client.aborts

    assert asyncio.run(run()) == ("done", 0)
