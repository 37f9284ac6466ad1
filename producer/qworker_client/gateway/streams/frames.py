"""A response's output streams as OpenAI sees them: SSE frames live, or the whole body at the end.

Each frame comes from one entry of a job's output stream and carries its entry id as the SSE
`id:` (prefixed `<choice index>/` when a response has several choices), so a client that lost its
connection resumes after the last id it saw, and gets every chunk exactly once.

With `coalesce` (the gateway's stream interval), the tokens of a choice that one read brings go
out as one chunk (their texts joined, the id of the last one's entry), as vLLM's
`--stream-interval` joins tokens: OpenAI's deltas may hold several tokens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from qworker_client.gateway.chat import shaping
from qworker_client.gateway.chat.chunks import ChoiceFrames
from qworker_client.gateway.chat.shaping import Shape
from qworker_client.gateway.errors import from_job_error
from qworker_client.gateway.metrics import Metrics
from qworker_client.gateway.streams.reader import Batch, Event, OutputReader
from qworker_client.gateway.streams.sse import DONE, frame
from qworker_client.gateway.streams.tokens import Text
from qworker_client.protocol import DoneEvent, ErrorEvent, TokenLogprob


@dataclass(frozen=True)
class Follow:
    """What to follow: each job's choice index and prompt index (usage counts a prompt once)."""

    shape: Shape
    index: dict[str, int]
    prompt: dict[str, int]
    include_usage: bool
    tagged: bool  # SSE ids as `<index>/<entry id>` (several choices in one stream)
    cancel: Callable[[list[str]], Awaitable[None]]
    coalesce: bool = False  # the tokens of one read as one chunk


@dataclass
class _Usage:
    prompt: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, prompt_index: int, done: DoneEvent) -> None:
        self.prompt[prompt_index] = done.prompt_tokens
        self.completion += done.completion_tokens


class Framer:
    """The SSE frames of a response's events, one read of a job at a time (`add`), then the end
    of the stream (`ending`)."""

    def __init__(self, follow: Follow, metrics: Metrics) -> None:
        self.follow = follow
        self.metrics = metrics
        self.usage = _Usage()
        self.last: tuple[ChoiceFrames, str] | None = None  # the choice and entry id last framed
        self.choices = {job_id: ChoiceFrames(follow.shape, index, follow.tagged)
                        for job_id, index in follow.index.items()}

    def add(self, batch: Batch, parts: list[str]) -> bool:
        """Append the frames of one job's events of a read (never none) to `parts`; True when
        the job failed (its error frame is the last)."""
        choice = self.choices[batch[0][0]]
        _, last_entry, last_event = batch[-1]
        self.last = choice, last_entry
        if (len(batch) == 1 and type(last_event) is Text and last_event.logprobs is None
                and not last_event.rich):
            self.metrics.count_tokens(1)  # what most reads bring a stream: one token
            part = choice.text(last_entry, last_event.i, last_event.text)
            if part is not None:
                parts.append(part)
            return False
        # its tokens: all but an end, always last
        self.metrics.count_tokens(len(batch) - (not isinstance(last_event, Text)))
        return _frames_of(coalesced(batch) if self.follow.coalesce else batch, choice,
                          self.usage, self.follow, parts)

    def ending(self) -> list[str]:
        """Once every job has ended: the usage chunk if asked, and `[DONE]`."""
        return _ending(self.follow, self.usage, self.last)


def _ending(follow: Follow, usage: _Usage, last: tuple[ChoiceFrames, str] | None) -> list[str]:
    """The usage chunk if asked (with the last event's id), and `[DONE]`."""
    if not follow.include_usage:
        return [DONE]
    event_id = None if last is None else last[0].event_id(last[1])
    return [frame(shaping.usage_chunk(follow.shape, sum(usage.prompt.values()),
                                      usage.completion), event_id), DONE]


def _frames_of(batch: Batch, choice: ChoiceFrames, usage: _Usage, follow: Follow,
               parts: list[str]) -> bool:
    """Append the frames of one job's events of a read to `parts`; True when the job failed
    (its error frame is the last)."""
    for job_id, entry_id, event in batch:
        if isinstance(event, Text):
            part = (choice.rich(entry_id, event) if event.rich
                    else choice.text(entry_id, event.i, event.text) if event.logprobs is None
                    else choice.logprob_text(entry_id, event.i, event.text, event.logprobs))
            if part is not None:
                parts.append(part)
        elif isinstance(event, DoneEvent):
            usage.add(follow.prompt[job_id], event)
            parts.append(choice.finish(entry_id, event.finish_reason))
        else:
            parts.append(frame(from_job_error(event.code, event.message).body(),
                               choice.event_id(entry_id)))
            return True
    return False


def coalesced(batch: Batch) -> Batch:
    """`batch` (one job's events of one read) with each run of tokens as one token: the first's
    index, their texts joined, the last one's entry id."""
    if len(batch) == 1:
        return batch  # most reads bring one entry of a stream
    out: Batch = []
    run: list[Text] = []
    for item in batch:
        event = item[2]
        if isinstance(event, Text):
            run.append(event)
            last = item
            continue
        if run:
            out.append(_joined(run, last))
            run = []
        out.append(item)
    if run:
        out.append(_joined(run, last))
    return out


def _joined(run: list[Text], last: tuple[str, str, Event]) -> tuple[str, str, Event]:
    """A run of tokens (`last` the item of its last one) as one token."""
    if len(run) == 1:
        return last
    entries = [entry for event in run for entry in event.logprobs or ()]
    reasoning = "".join(event.reasoning or "" for event in run)
    calls = [d for event in run for d in event.tool_calls or ()]
    return last[0], last[1], Text(run[0].i, "".join([event.text for event in run]),
                                  entries or None, reasoning or None, calls or None)


async def body(reader: OutputReader, follow: Follow) -> dict[str, Any]:
    """The whole response, once every job has ended; a job's error is the response's."""
    done: dict[int, DoneEvent] = {}
    entries: dict[int, list[TokenLogprob]] = {i: [] for i in follow.index.values()}
    usage = _Usage()
    async for job_id, _, event in reader.events():
        if isinstance(event, Text):
            entries[follow.index[job_id]] += event.logprobs or ()
        if isinstance(event, ErrorEvent):
            await follow.cancel(list(reader.open))
            raise from_job_error(event.code, event.message)
        if isinstance(event, DoneEvent):
            done[follow.index[job_id]] = event
            usage.add(follow.prompt[job_id], event)
    ordered = [done[i] for i in sorted(done)]
    return shaping.body(follow.shape, ordered, sum(usage.prompt.values()),
                        [entries[i] for i in sorted(done)])
