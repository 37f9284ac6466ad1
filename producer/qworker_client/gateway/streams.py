"""A response's output streams as OpenAI sees them: SSE frames live, or the whole body at the end.

Each frame comes from one entry of a job's output stream and carries its entry id as the SSE
`id:` (prefixed `<choice index>/` when a response has several choices), so a client that lost its
connection resumes after the last id it saw, and gets every chunk exactly once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from qworker_client.gateway import shaping
from qworker_client.gateway.errors import from_job_error
from qworker_client.gateway.metrics import Metrics
from qworker_client.gateway.reader import OutputReader
from qworker_client.gateway.shaping import Shape
from qworker_client.gateway.sse import DONE, frame
from qworker_client.protocol import DoneEvent, ErrorEvent, TokenEvent


@dataclass(frozen=True)
class Follow:
    """What to follow: each job's choice index and prompt index (usage counts a prompt once)."""

    shape: Shape
    index: dict[str, int]
    prompt: dict[str, int]
    include_usage: bool
    tagged: bool  # SSE ids as `<index>/<entry id>` (several choices in one stream)
    cancel: Callable[[list[str]], Awaitable[None]]


@dataclass
class _Usage:
    prompt: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, prompt_index: int, done: DoneEvent) -> None:
        self.prompt[prompt_index] = done.prompt_tokens
        self.completion += done.completion_tokens


async def frames(reader: OutputReader, follow: Follow, metrics: Metrics
                 ) -> AsyncGenerator[str, None]:
    """The SSE frames of the jobs' events, then the usage chunk if asked, then `[DONE]`: the
    frames of one read go out as one piece."""
    usage, event_id = _Usage(), None
    metrics.streams_open.inc()
    try:
        async for batch in reader.batches():
            parts: list[str] = []
            failed = False
            for job_id, entry_id, event in batch:
                index = follow.index[job_id]
                event_id = f"{index}/{entry_id}" if follow.tagged else entry_id
                if isinstance(event, ErrorEvent):
                    parts.append(frame(from_job_error(event.code, event.message).body(),
                                       event_id))
                    failed = True
                    break
                if isinstance(event, DoneEvent):
                    usage.add(follow.prompt[job_id], event)
                chunk = _chunk(follow.shape, index, event)
                if chunk is not None:
                    parts.append(frame(chunk, event_id))
            metrics.tokens.inc(sum(isinstance(e, TokenEvent) for _, _, e in batch))
            if parts:
                yield "".join(parts)
            if failed:
                await follow.cancel(list(reader.open))
                break
        else:
            if follow.include_usage:
                yield frame(shaping.usage_chunk(follow.shape, sum(usage.prompt.values()),
                                                usage.completion), event_id)
        yield DONE
    finally:
        metrics.streams_open.dec()


def _chunk(shape: Shape, index: int, event: TokenEvent | DoneEvent) -> dict[str, Any] | None:
    if isinstance(event, DoneEvent):
        return shaping.finish_chunk(shape, index, event.finish_reason)
    first = shape.kind == "chat" and event.i == 0
    if not event.text and not first:
        return None  # text held back: nothing to send yet
    return shaping.text_chunk(shape, index, event.text, first)


async def body(reader: OutputReader, follow: Follow) -> dict[str, Any]:
    """The whole response, once every job has ended; a job's error is the response's."""
    done: dict[int, DoneEvent] = {}
    usage = _Usage()
    async for job_id, _, event in reader.events():
        if isinstance(event, ErrorEvent):
            await follow.cancel(list(reader.open))
            raise from_job_error(event.code, event.message)
        if isinstance(event, DoneEvent):
            done[follow.index[job_id]] = event
            usage.add(follow.prompt[job_id], event)
    ordered = [done[i] for i in sorted(done)]
    return shaping.body(follow.shape, ordered, sum(usage.prompt.values()))
