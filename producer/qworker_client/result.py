"""What reading a job's output stream yields: events in, a `Result` or a `JobError` out.

`OutputState` is the part shared by the sync and asyncio clients: it remembers the last entry id
seen (where a read resumes), how many token indices it has passed on, and how the job ended.

A stream can roll back: Redis restarted from an AOF that lost its last second (`appendfsync
everysec`), or a replica without the last writes was promoted. The job then runs again from what
the stream still holds and appends token indices this reader has already seen, possibly followed by
a second terminal event. So a token whose `i` was passed on already is skipped, and nothing is
taken after the first `done` or `error` (docs/protocol.md, "The read loop").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from qworker_client.protocol import (
    AnyEvent,
    DoneEvent,
    ErrorEvent,
    PromptLogprobsEvent,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    parse_event,
)

OutputEvent = TokenEvent | DoneEvent | ErrorEvent

# `XREAD ... STREAMS key 0-0` reads a stream from its first entry.
START_ID = "0-0"


class JobError(Exception):
    """The job ended with an `error` event."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed: {code}: {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


class JobTimeoutError(TimeoutError):
    """No `done` or `error` event within the time asked for; the job may still be running."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timings:
    """Milliseconds from when the job was first queued."""

    queue_ms: int
    ttft_ms: int
    total_ms: int


@dataclass(frozen=True)
class Result:
    job_id: str
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    # a job with `logprobs`: each generated token's (as read by this handle); with
    # `prompt_logprobs`: the prompt tokens' from the second on
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None  # a job with tools: the calls it made
    reasoning: str | None = None  # a thinking model's thinking, apart from `text`

    @classmethod
    def from_done(cls, job_id: str, done: DoneEvent, logprobs: list[TokenLogprob] | None = None,
                  prompt_logprobs: list[TokenLogprob] | None = None) -> Result:
        return cls(
            job_id=job_id,
            text=done.text,
            finish_reason=done.finish_reason,
            usage=Usage(done.prompt_tokens, done.completion_tokens),
            timings=Timings(done.queue_ms, done.ttft_ms, done.total_ms),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            tool_calls=done.tool_calls,
            reasoning=done.reasoning,
        )


def result_fields(result: Result) -> dict[str, Any]:
    """`asdict(result)` ready for JSON: pydantic entries dumped (asdict copies them as they are);
    `tool_calls` and `reasoning` only where the job had them."""
    data = asdict(result)
    for name in ("logprobs", "prompt_logprobs", "tool_calls"):
        entries = getattr(result, name)
        if entries is not None:
            data[name] = [e.model_dump(exclude_none=True) for e in entries]
    for name in ("tool_calls", "reasoning"):
        if data[name] is None:
            del data[name]
    return data


def token_logprob(event: TokenEvent) -> TokenLogprob | None:
    """A token event's logprob entry (None: the job did not ask for logprobs)."""
    if event.logprob is None:
        return None
    return TokenLogprob(token_id=event.token_id, logprob=event.logprob, token=event.token,
                        top_logprobs=event.top_logprobs)


@dataclass
class OutputState:
    """Progress through one job's output stream."""

    job_id: str
    last_id: str = START_ID
    next_index: int = 0  # token indices below it were passed on: any repeat of them is skipped
    done: DoneEvent | None = None
    error: ErrorEvent | None = None
    logprobs: list[TokenLogprob] | None = None  # of the tokens passed on, when they carry them
    prompt_logprobs: list[TokenLogprob] | None = None  # from the prompt_logprobs event

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def apply(self, entry_id: str, fields: Mapping[str, str]) -> OutputEvent | None:
        """Take one entry as seen: the event to pass on, or None for a token index seen before
        or anything after the job's end. Remembers the terminal event."""
        self.last_id = entry_id
        if self.finished:
            return None
        event: AnyEvent = parse_event(fields)
        if isinstance(event, PromptLogprobsEvent):  # kept, not passed on (see Result)
            self.prompt_logprobs = list(event.prompt_logprobs)
            return None
        if isinstance(event, TokenEvent):
            if event.i < self.next_index:
                return None
            self.next_index = event.i + 1
            if (entry := token_logprob(event)) is not None:
                self.logprobs = [*(self.logprobs or []), entry]
        elif isinstance(event, DoneEvent):
            self.done = event
        else:
            self.error = event
        return event

    def job_error(self) -> JobError:
        assert self.error is not None
        return JobError(self.job_id, self.error.code, self.error.message)

    def result(self) -> Result:
        """The result of a finished job, or its JobError raised."""
        if self.error is not None:
            raise self.job_error()
        assert self.done is not None
        return Result.from_done(self.job_id, self.done, self.logprobs, self.prompt_logprobs)


def stream_entries(response: object) -> list[tuple[str, dict[str, str]]]:
    """The entries of an XREAD reply: RESP2 `[[key, entries]]` or RESP3 `{key: [entries]}`."""
    if not response:
        return []
    if isinstance(response, dict):
        batches = [entries for value in response.values() for entries in value]
    else:
        assert isinstance(response, list)
        batches = [entries for _key, entries in response]
    return [(entry_id, fields) for entries in batches for entry_id, fields in entries]
