"""A job's token stream as Server-Sent Events, as it is written: the resumable read of the
gateway's `/v1/jobs/{id}/stream` (each event's `id:` is its output entry id, so a browser that
reconnects sends `Last-Event-ID` and goes on after it), a token index seen before skipped,
nothing after the first `done` or `error` (docs/protocol.md, "The read loop")."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

from qworker_client.protocol import DoneEvent, ErrorEvent, Keys, TokenEvent, parse_event

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
    deadline = time.monotonic() + FOLLOW_S
    try:
        yield "retry: 2000\n\n"
        while time.monotonic() < deadline:
            reply: Any = client.xread({keys.out(job_id): after}, count=500, block=BLOCK_MS)
            if not reply:
                yield ": waiting\n\n"
                continue
            for raw_id, raw_fields in reply[0][1]:
                after = str(raw_id)  # the client decodes replies
                frame, ended, next_index = _frame(after, raw_fields, next_index)
                if frame:
                    yield frame
                if ended:
                    return
    finally:
        _live.release()


def _frame(entry_id: str, raw: dict[str, str], next_index: int) -> tuple[str, bool, int]:
    try:
        event = parse_event(raw)
    except ValueError:
        return "", False, next_index
    if isinstance(event, TokenEvent):
        if event.i < next_index:
            return "", False, next_index
        return _sse(entry_id, "token", {"i": event.i, "text": event.text}), False, event.i + 1
    if isinstance(event, DoneEvent):
        data = {"finish_reason": event.finish_reason, "text": event.text,
                "completion_tokens": event.completion_tokens, "ttft_ms": event.ttft_ms,
                "total_ms": event.total_ms}
        return _sse(entry_id, "done", data), True, next_index
    if isinstance(event, ErrorEvent):
        return _sse(entry_id, "failed", {"code": event.code, "message": event.message}), True, \
            next_index
    return "", False, next_index


def _sse(entry_id: str, kind: str, data: dict[str, object]) -> str:
    return f"id: {entry_id}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"
