"""A job this worker holds: where its entry is, what was already shown, what is still to publish;
and the two ways an entry reaches it from intake: taken (`Taken`) or refused (`Reject`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from qworker_client.protocol import (
    DoneEvent,
    ErrorEvent,
    FinishReason,
    Job,
    PromptLogprobsEvent,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    entry_ms,
    parse_event,
)

Event = TokenEvent | DoneEvent | ErrorEvent | PromptLogprobsEvent
RawFields = dict[bytes, bytes]


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Entry:
    """One stream entry delivered to this worker."""

    stream: str
    entry_id: str
    fields: RawFields
    deliveries: int = 1
    reclaimed: bool = False
    charged: bool = False  # its estimated tokens were added to this minute's when handed out
    displaces: str | None = None  # handed to a full worker: the tenant to preempt for it


@dataclass
class Readback:
    """What `<prefix>:out:<id>` already holds: the truth a resumed job continues from."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    terminal: bool = False
    first_token_ms: int | None = None
    consistent: bool = True  # False: indices were not 0..n-1 (only the prefix that was is used)

    @classmethod
    def parse(cls, entries: Sequence[tuple[Any, dict[bytes, bytes]]]) -> Readback:
        rb = cls()
        for entry_id, fields in entries:
            try:
                event = parse_event(fields)
            except ValueError:
                rb.consistent = False
                break
            if isinstance(event, PromptLogprobsEvent):
                continue
            if isinstance(event, TokenEvent):
                if event.i != len(rb.token_ids):
                    rb.consistent = False
                    break
                if rb.first_token_ms is None:
                    rb.first_token_ms = entry_ms(_str(entry_id))
                rb.token_ids.append(event.token_id)
                rb.text += event.text
                rb.reasoning += event.reasoning or ""
            else:
                rb.terminal = True
                break
        return rb


@dataclass
class Reject:
    """An entry that will not run: acked, dead-lettered, and an error event when `job_id`."""

    entry: Entry
    code: str
    message: str
    job_id: str | None
    drop_owner: bool = False  # the job's owner hash goes too (we or a dead worker set it)
    job: Job | None = None  # the job, where it parsed (how long its error event lives)


@dataclass
class Taken:
    """A job now owned by this worker, with what its output stream already holds."""

    entry: Entry
    job: Job
    readback: Readback
    cancelled: bool
    t0_ms: int
    started_ms: int
    started_before: bool = False  # some worker took it before (it may have streamed tokens)
    crashes: int = 0  # its workers that died (or stalled) while they ran it alone
    excused: int = 0  # its workers that died (or stalled) while they ran another job alone
    requeued: bool = False  # read from a requeue stream (preempted, or at a worker's shutdown)

    @property
    def job_id(self) -> str:
        return self.job.id or self.entry.entry_id

    def waited_ms(self, now: int) -> int:
        """How long it has waited, not counting the time it ran (priority aging): a requeued job
        until it first started plus since its requeue entry; any other since first queued.
        Short: waits between a requeue and the next start before the last are not counted."""
        since = entry_ms(self.entry.entry_id) if self.requeued else None
        if since is None:
            return max(0, now - self.t0_ms)
        return max(0, self.started_ms - self.t0_ms) + max(0, now - since)


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class ActiveJob:
    """A job taken by this worker: in the engine, or finished with events still to publish."""

    job: Job
    entry: Entry
    log: Any
    t0_ms: int  # first queued (the original entry's time, kept across requeues)
    started_ms: int  # first taken by any worker
    next_index: int = 0  # index of the next token to publish
    text: str = ""  # text shown so far (read back + published deltas)
    reasoning: str = ""  # thinking shown so far, the same way
    tool_calls: list[dict[str, Any]] | None = None  # the engine's, when it finished the job
    first_token_ms: int | None = None
    prompt_tokens: int = 0
    outbox: list[Event] = field(default_factory=list)  # not yet confirmed written
    finished: bool = False  # a terminal event is in the outbox; the engine has let go
    requeue: bool = False  # to requeue once the outbox is written; the engine has let go

    @property
    def job_id(self) -> str:
        return self.job.id or self.entry.entry_id

    @property
    def in_engine(self) -> bool:
        return not (self.finished or self.requeue)

    def out_of_time(self, now: int) -> bool:
        """Past its run-time limit (`timeout_ms`), counted from when a worker first started it."""
        limit = self.job.timeout_ms
        return limit is not None and now >= self.started_ms + limit

    def add_tokens(self, first_index: int, token_ids: list[int], text: str,
                   logprobs: list[TokenLogprob] | None = None, reasoning: str = "",
                   tool_calls: list[dict[str, Any]] | None = None) -> None:
        """Token events; the text, thinking and call deltas go on the last of them."""
        assert logprobs is None or len(logprobs) == len(token_ids), "one logprob entry a token"
        for k, token_id in enumerate(token_ids):
            last = k == len(token_ids) - 1
            lp = logprobs[k] if logprobs else None
            self.outbox.append(TokenEvent(
                i=first_index + k, token_id=token_id, text=text if last else "",
                logprob=lp.logprob if lp else None, top_logprobs=lp.top_logprobs if lp else None,
                token=lp.token if lp else None, reasoning=reasoning or None if last else None,
                tool_calls=tool_calls if last else None))
        if token_ids:
            self.next_index = first_index + len(token_ids)
            self.text += text
            self.reasoning += reasoning
            if self.first_token_ms is None:
                self.first_token_ms = now_ms()

    def add_prompt_logprobs(self, entries: list[TokenLogprob]) -> None:
        """The prompt_logprobs event: it goes out before the first token (in the same write)."""
        assert self.next_index == 0 and not any(isinstance(e, TokenEvent) for e in self.outbox)
        self.outbox.append(PromptLogprobsEvent(prompt_logprobs=entries))

    def finish(self, finish_reason: FinishReason, completion_tokens: int) -> DoneEvent:
        done_ms = now_ms()
        first = self.first_token_ms if self.first_token_ms is not None else done_ms
        event = DoneEvent(
            finish_reason=finish_reason,
            text=self.text,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            queue_ms=max(0, self.started_ms - self.t0_ms),
            ttft_ms=max(0, first - self.t0_ms),
            total_ms=max(0, done_ms - self.t0_ms),
            tool_calls=[ToolCall.model_validate(c) for c in self.tool_calls or ()] or None,
            reasoning=self.reasoning or None,
        )
        self.outbox.append(event)
        self.finished = True
        return event
