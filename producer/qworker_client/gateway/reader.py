"""Following the output streams of a response's jobs over `redis.asyncio`: one XREAD a turn over
every stream not ended yet, each taken as `OutputState` takes it (docs/protocol.md, "The read
loop": a token index seen before is skipped, nothing after the first `done` or `error`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import redis.asyncio

from qworker_client.connect import DEFAULT_BLOCK_MS, READ_COUNT
from qworker_client.multiplex import BAD_EVENT, xread_by_stream
from qworker_client.protocol import ErrorEvent, Keys
from qworker_client.result import OutputEvent, OutputState
from qworker_client.retry import TRANSIENT_ERRORS, Backoff

GIVE_UP_S = 60.0  # a dropped connection is retried this long


class OutputReader:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys, after: Mapping[str, str],
                 block_ms: int = DEFAULT_BLOCK_MS) -> None:
        """`after`: job id -> the entry id to read after ("0-0": from the start)."""
        self.client = client
        self.keys = keys
        self.block_ms = block_ms
        self.open = {job_id: OutputState(job_id, last) for job_id, last in after.items()}
        self._out_prefix = keys.out("")

    async def events(self) -> AsyncIterator[tuple[str, str, OutputEvent]]:
        """(job id, entry id, event) for every event to pass on, until every job has ended."""
        while self.open:
            for key, entries in xread_by_stream(await self._xread()):
                job_id = key.removeprefix(self._out_prefix)
                state = self.open[job_id]
                for entry_id, fields in entries:
                    event = _apply(state, entry_id, fields)
                    if event is not None:
                        yield job_id, entry_id, event
                if state.finished:
                    del self.open[job_id]

    async def _xread(self) -> object:
        streams = {self.keys.out(job_id): s.last_id for job_id, s in self.open.items()}
        backoff = Backoff(give_up_s=GIVE_UP_S)
        while True:
            try:
                return await self.client.xread(streams, count=READ_COUNT, block=self.block_ms)
            except TRANSIENT_ERRORS as exc:
                await asyncio.sleep(backoff.failed(exc))


def _apply(state: OutputState, entry_id: str, fields: Mapping[str, str]) -> OutputEvent | None:
    try:
        return state.apply(entry_id, fields)
    except ValueError as exc:  # not an event of the protocol: the job cannot be followed
        if fields.get("type") == "token":
            return None
        state.error = ErrorEvent(code=BAD_EVENT, message=f"unreadable output event: {exc}")
        return state.error
