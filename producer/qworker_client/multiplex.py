"""Following many jobs' output streams (`<prefix>:out:<id>`) at once, one XREAD a turn over every
stream not yet ended: the batch runner, the demo and the service benchmark read with it.

Each job's stream is taken as `OutputState` takes it (the sync client's rule, docs/protocol.md
"The read loop"): a token index passed on before is skipped, and nothing after the first `done`
or `error` is passed on or read again. An entry that is not an event of the protocol ends its job
with a `bad_event` error, except a token entry, which is skipped; so does an output key that Redis
refuses to read (not a stream): an error reply to the read of every stream is one stream's, found
by reading the halves again (not blocking) until each that fails is alone, and the other jobs read
on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis
from redis.typing import KeyT, StreamIdT

from qworker_client.connect import DEFAULT_BLOCK_MS, READ_COUNT
from qworker_client.protocol import ErrorEvent, Keys
from qworker_client.result import START_ID, OutputEvent, OutputState
from qworker_client.retry import with_retry

BAD_EVENT = "bad_event"  # error code of an output stream (or entry) that breaks the protocol

Entries = list[tuple[str, dict[str, str]]]


def xread_by_stream(reply: object) -> list[tuple[str, Entries]]:
    """An XREAD reply as (key, entries) pairs: RESP2 `[[key, entries]]` or RESP3
    `{key: [entries]}`."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(key, entries) for key, value in reply.items() for entries in value]
    assert isinstance(reply, list)
    return [(key, entries) for key, entries in reply]


def unreadable_stream(exc: Exception) -> ErrorEvent:
    """The end of a job whose output stream Redis refuses to read (a key that is not a stream)."""
    return ErrorEvent(code=BAD_EVENT, message=f"its output stream cannot be read: {exc}")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Multiplexer:
    """The output streams of the jobs followed; `read()` takes one turn. Works with clients that
    decode responses and with those that do not."""

    def __init__(self, client: redis.Redis, keys: Keys | None = None, *,
                 block_ms: int = DEFAULT_BLOCK_MS, count: int = READ_COUNT,
                 give_up_s: float | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.block_ms = block_ms
        self.count = count
        self.give_up_s = give_up_s  # None: a dropped connection raises; else retried this long
        self.open: dict[str, OutputState] = {}  # by job id: the jobs not ended yet
        self.replied_at = 0.0  # time.time() when the last XREAD returned (before any parsing)
        self._out_prefix = self.keys.out("")

    def __len__(self) -> int:
        return len(self.open)

    def follow(self, job_id: str, last_id: str = START_ID) -> None:
        """Read `job_id`'s stream from after `last_id` (by default from its start)."""
        self.open[job_id] = OutputState(job_id, last_id)

    def read(self) -> list[tuple[str, OutputEvent]]:
        """One XREAD (blocking up to `block_ms`) over every open stream: (job id, event) for each
        event to pass on, in stream order per job. A job whose end was read is no longer open."""
        if not self.open:
            return []
        positions = {job_id: state.last_id for job_id, state in self.open.items()}
        read, failed = self._read_scoped(positions, self.block_ms)
        self.replied_at = time.time()
        events: list[tuple[str, OutputEvent]] = []
        for key, entries in read:
            job_id = _text(key).removeprefix(self._out_prefix)
            state = self.open[job_id]
            events += [(job_id, event) for event in _take(state, entries)]
            if state.finished:
                del self.open[job_id]
        for job_id, exc in failed.items():
            self.open.pop(job_id).error = event = unreadable_stream(exc)
            events.append((job_id, event))
        return events

    def _read_scoped(self, positions: dict[str, str], block: int | None
                     ) -> tuple[list[tuple[str, Entries]], dict[str, redis.ResponseError]]:
        """An XREAD of these jobs' streams (job id -> last entry id): what each stream brought,
        and by job id the error of each that fails alone (after an error reply, the halves are
        read again, not blocking)."""
        try:
            return xread_by_stream(self._xread(positions, block)), {}
        except redis.ResponseError as exc:
            if len(positions) == 1:
                return [], dict.fromkeys(positions, exc)
        items = list(positions.items())
        read: list[tuple[str, Entries]] = []
        failed: dict[str, redis.ResponseError] = {}
        for half in (items[:len(items) // 2], items[len(items) // 2:]):
            half_read, half_failed = self._read_scoped(dict(half), None)
            read += half_read
            failed.update(half_failed)
        return read, failed

    def _xread(self, positions: dict[str, str], block: int | None) -> object:
        streams: dict[KeyT, StreamIdT] = {self.keys.out(job_id): last_id
                                          for job_id, last_id in positions.items()}

        def call() -> object:
            return self.client.xread(streams, count=self.count, block=block)

        return call() if self.give_up_s is None else with_retry(call, self.give_up_s)


def _take(state: OutputState, entries: Entries) -> list[OutputEvent]:
    taken = []
    for entry_id, fields in entries:
        try:
            event = state.apply(_text(entry_id), fields)
        except ValueError as exc:  # not an event of the protocol
            event = _unreadable(state, fields, exc)
        if event is not None:
            taken.append(event)
    return taken


def _unreadable(state: OutputState, fields: Mapping[Any, Any], exc: ValueError
                ) -> ErrorEvent | None:
    if _text(fields.get("type", fields.get(b"type", ""))) == "token":
        return None
    state.error = ErrorEvent(code=BAD_EVENT, message=f"unreadable output event: {exc}")
    return state.error
