"""Following the output streams of one response's jobs, through the gateway's `Hub` (one XREAD a
turn for the whole process), each taken as `OutputState` takes it (docs/protocol.md, "The read
loop": a token index seen before is skipped, nothing after the first `done` or `error`).

A token is passed on as a `Text` (its index and new text), a plain token entry read without
pydantic (`tokens.plain_token_listed`, on the fields as the reply lists them); a job's end as its
`DoneEvent` or `ErrorEvent`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

from qworker_client.gateway.streams.hub import Entries, Follower, Hub, Mailbox
from qworker_client.gateway.streams.tokens import Text, plain_token_listed
from qworker_client.gateway.streams.vanished import Queued
from qworker_client.multiplex import BAD_EVENT
from qworker_client.protocol import DoneEvent, ErrorEvent, TokenEvent
from qworker_client.result import OutputState, token_logprob

Event = Text | DoneEvent | ErrorEvent
Batch = list[tuple[str, str, Event]]  # (job id, entry id, event)


class OutputReader:
    def __init__(self, hub: Hub, after: Mapping[str, str],
                 queued: dict[str, Queued] | None = None) -> None:
        """`after`: job id -> the entry id to read after ("0-0": from the start); `queued`:
        where the jobs were queued, when known (`Hub.follow`)."""
        self.hub = hub
        self.after = dict(after)
        self.queued = queued
        self.open = {job_id: OutputState(job_id, last) for job_id, last in after.items()}
        self._follower: Follower | None = None  # from the first take, or `push`

    async def events(self) -> AsyncIterator[tuple[str, str, Event]]:
        """(job id, entry id, event) for every event to pass on, until every job has ended."""
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[Batch]:
        """`events()` as the reads bring them: one list per job per read (never empty)."""
        try:
            while self.open:
                for batch in await self.take():
                    yield batch
        finally:
            self.close()

    async def take(self) -> list[Batch]:
        """The batches of the next read that brings any (one per job, none empty); [] once
        every job has ended. `close` when done with it."""
        if self._follower is None:
            self._follower = Mailbox()
            self.hub.follow(self.after, self._follower, self.queued)
        assert isinstance(self._follower, Mailbox), "the reader pushes"
        batches: list[Batch] = []
        while self.open and not batches:
            for item in await self._follower.take():
                if isinstance(item, BaseException):
                    raise item
                batch = self.batch(*item)
                if batch:
                    batches.append(batch)
        return batches

    def push(self, follower: Follower) -> None:
        """Instead of `take`: the hub's reads hand each job's new entries to `follower` as they
        come (its `put_nowait`, in the read loop), which passes them to `batch`."""
        assert self._follower is None, "the reader is already following"
        self._follower = follower
        self.hub.follow(self.after, follower, self.queued)

    def close(self) -> None:
        """Stop following the jobs."""
        if self._follower is not None:
            self.hub.drop(list(self.after), self._follower)

    def batch(self, job_id: str, entries: Entries) -> Batch:
        """The events to pass on of one job's new entries that a read brought (none once it has
        ended)."""
        state = self.open.get(job_id)
        if state is None:
            return []
        batch: Batch = []
        for entry_id, fields in entries:
            token = None if state.finished else plain_token_listed(fields)
            if token is None:  # another event, a token written otherwise, or past the end
                if (event := _other(state, entry_id, fields)) is not None:
                    batch.append((job_id, entry_id, event))
                continue
            state.last_id = entry_id
            if token.i >= state.next_index:  # else an index passed on before (a rollback)
                state.next_index = token.i + 1
                batch.append((job_id, entry_id, token))
        if state.finished:
            del self.open[job_id]
            assert self._follower is not None
            self.hub.drop([job_id], self._follower)
        return batch


def _other(state: OutputState, entry_id: str, listed: Sequence[str]) -> Event | None:
    """`OutputState.apply` of an entry's fields (field, value, ...) that is not a plain token
    entry of a job still running (those `batch` takes without pydantic)."""
    event = _apply(state, entry_id, dict(zip(listed[::2], listed[1::2], strict=True)))
    if isinstance(event, TokenEvent):
        entry = token_logprob(event)
        return Text(event.i, event.text, None if entry is None else [entry], event.reasoning,
                    event.tool_calls)
    return event


def _apply(state: OutputState, entry_id: str, fields: Mapping[str, str]
           ) -> TokenEvent | DoneEvent | ErrorEvent | None:
    try:
        return state.apply(entry_id, fields)
    except ValueError as exc:  # not an event of the protocol: the job cannot be followed
        if fields.get("type") == "token":
            return None
        state.error = ErrorEvent(code=BAD_EVENT, message=f"unreadable output event: {exc}")
        return state.error
