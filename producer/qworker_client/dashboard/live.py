"""A job's token stream as Server-Sent Events, as it is written: the resumable read of the
gateway's `/v1/jobs/{id}/stream` (each event's `id:` is its output entry id, so a browser that
reconnects sends `Last-Event-ID` and goes on after it), taken as the client's `OutputState` takes
it (docs/protocol.md, "The read loop": a token index seen before is skipped, nothing after the
first `done` or `error`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

from qworker_client.protocol import DoneEvent, ErrorEvent, Keys, TokenEvent
from qworker_client.result import OutputState, stream_entries

MAX_LIVE = 16  # live streams at once (each holds one of the pool's 40 threads, in XREAD)
BLOCK_MS = 1_000
FOLLOW_S = 600.0  # a stream is ended after this long (the browser reconnects, and resumes)
_live = threading.BoundedSemaphore(MAX_LIVE)


def try_open() -> bool:
    """Room for one more live stream (then `events` releases it)."""
    return _live.acquire(blocking=False)


def events(client: redis.Redis, keys: Keys, job_id: str, after: str, next_index: int
           ) -> Iterator[str]:
    """SSE frames of the job's events after entry `after` (token indexes from `next_index`)."""
    state = OutputState(job_id, after, next_index)
    deadline = time.monotonic() + FOLLOW_S
    try:
        yield "retry: 2000\n\n"
        while time.monotonic() < deadline and not state.finished:
            reply: Any = client.xread({keys.out(job_id): state.last_id}, count=500,
                                      block=BLOCK_MS)
            entries = stream_entries(reply)
            if not entries:
                yield ": waiting\n\n"
            for entry_id, fields in entries:
                try:
                    event = state.apply(entry_id, fields)
                except ValueError:
                    continue  # not an event: skipped, as the client skips it
                if event is not None:
                    yield frame(entry_id, event)
    finally:
        _live.release()


def frame(entry_id: str, event: object) -> str:
    """One SSE event: `token` (its index and text), `done`, or `failed`; a comment otherwise."""
    if isinstance(event, TokenEvent):
        return _sse(entry_id, "token", {"i": event.i, "text": event.text})
    if isinstance(event, DoneEvent):
        return _sse(entry_id, "done", {"finish_reason": event.finish_reason, "text": event.text,
                                       "completion_tokens": event.completion_tokens,
                                       "ttft_ms": event.ttft_ms, "total_ms": event.total_ms})
    if isinstance(event, ErrorEvent):
        return _sse(entry_id, "failed", {"code": event.code, "message": event.message})
    return ": skipped\n\n"


def _sse(entry_id: str, kind: str, data: dict[str, object]) -> str:
    return f"id: {entry_id}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"
