"""A response's stream of events, made from its job's output stream, entry by entry.

The events are a function of the output stream alone (one `response.output_text.delta` per token
event with text, one `response.reasoning_text.delta` per token event with `reasoning`, the
function calls when the `done` event brings them), so any gateway, at any time, makes the same
events with the same `sequence_number`s: a stream resumed after event N by another gateway is
the rest of the one first sent.

One item streams at a time: a `reasoning` item while the tokens think, a `message` while they
answer; a token of the other kind closes it and opens the next. Token events seen before (a
rollback) and anything after the job's end are skipped, as `OutputState` takes a stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qworker_client.gateway.responses import shape
from qworker_client.gateway.responses.record import Final, StoredResponse
from qworker_client.multiplex import BAD_EVENT
from qworker_client.protocol import DoneEvent, ErrorEvent, TokenEvent
from qworker_client.result import START_ID, OutputState

Event = dict[str, Any]
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
             "cancelled": "response.incomplete", "failed": "response.failed"}


_KINDS = {  # an item's kind: its id's prefix, its part's type, its delta and done events
    "message": ("msg", "output_text", "response.output_text"),
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text"),
}


@dataclass
class _Open:
    """The item streaming now."""

    kind: str
    index: int
    item_id: str
    pieces: list[str] = field(default_factory=list)

    @property
    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.index, "content_index": 0}


class ResponseEvents:
    def __init__(self, stored: StoredResponse) -> None:
        self.stored = stored
        self.state = OutputState(stored.job_id)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.final: Final | None = None
        self.reasoning_tokens = 0
        self._open: _Open | None = None
        self._base = stored.id.removeprefix("resp_")  # item ids: the same from any gateway

    @property
    def ended(self) -> bool:
        return self.final is not None

    def status(self) -> str:
        """The response's status: `queued` until its job's first event (its first token)."""
        if self.final is not None:
            return self.final.status
        if self.stored.cancelled:
            return "cancelled"
        return "queued" if self.state.last_id == START_ID else "in_progress"

    def response(self) -> dict[str, Any]:
        """The response object as the events so far make it."""
        return shape.response_object(self.stored, self.status(), self._output_now(), self.final)

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def entry(self, entry_id: str, fields: Mapping[str, str]) -> list[Event]:
        """The events of one entry of the job's output stream (none for most kinds)."""
        try:
            event = self.state.apply(entry_id, dict(fields))
        except ValueError as exc:
            if fields.get("type") == "token":
                return []
            event = self.state.error = ErrorEvent(code=BAD_EVENT,
                                                  message=f"unreadable output event: {exc}")
        if isinstance(event, TokenEvent):
            return self._token(event.text, event.reasoning)
        if isinstance(event, DoneEvent):
            return self._done(event, shape.tool_calls(event.tool_calls))
        if isinstance(event, ErrorEvent):
            return self._error(event)
        return []

    def ended_as(self, final: Final) -> list[Event]:
        """The end kept in the record, for a response whose output stream has expired first:
        its events are not made again, only its terminal one."""
        self.final = final
        self.output = list(final.output)
        return [self._ending()]

    def _token(self, text: str, reasoning: str | None) -> list[Event]:
        events: list[Event] = []
        if reasoning:
            self.reasoning_tokens += 1
            events += self._write("reasoning", reasoning)
        if text:
            events += self._write("message", text)
        return events

    def _write(self, kind: str, piece: str) -> list[Event]:
        """A piece of text of the item of `kind`, opened (closing the other) if need be."""
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            events += self._open_item(kind)
        assert self._open is not None
        self._open.pieces.append(piece)
        return [*events, self._event(f"{_KINDS[kind][2]}.delta", **self._open.where,
                                     delta=piece, **_logprobs(kind))]

    def _open_item(self, kind: str) -> list[Event]:
        index = len(self.output)
        opened = self._open = _Open(kind, index, f"{_KINDS[kind][0]}_{self._base}_{index}")
        self.output.append(_item(opened, None, "in_progress"))
        return [self._event("response.output_item.added", output_index=index,
                            item=_item(opened, None, "in_progress")),
                self._event("response.content_part.added", **opened.where,
                            part=_part(kind, ""))]

    def _close(self, text: str | None = None) -> list[Event]:
        """Close the item streaming now, with `text` (else what it streamed)."""
        opened, self._open = self._open, None
        if opened is None:
            return []
        text = "".join(opened.pieces) if text is None else text
        item = _item(opened, text, "completed")
        self.output[opened.index] = item
        return [self._event(f"{_KINDS[opened.kind][2]}.done", **opened.where, text=text,
                            **_logprobs(opened.kind)),
                self._event("response.content_part.done", **opened.where,
                            part=_part(opened.kind, text)),
                self._event("response.output_item.done", output_index=opened.index, item=item)]

    def _done(self, done: DoneEvent, calls: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        messages = [item for item in self.output if item["type"] == "message"]
        if not messages and done.text:  # its text was held back to the end
            events += self._write("message", done.text)
            messages = [self.output[-1]]
        opened = self._open
        whole = opened is not None and opened.kind == "message" and len(messages) == 1
        events += self._close(done.text if whole else None)  # the text as its end has it
        for k, call in enumerate(calls):
            events += self._call(k, call)
        reason = "tool_calls" if calls else done.finish_reason
        completed_at = self.stored.created_at + round(done.total_ms / 1000)  # any gateway's
        self.final = shape.final_of_done(done, reason, list(self.output), completed_at,
                                         self.reasoning_tokens)
        return [*events, self._ending()]

    def _call(self, k: int, call: dict[str, Any]) -> list[Event]:
        item_id, index = f"fc_{self._base}_{k}", len(self.output)
        item = shape.function_call(item_id, call, call["arguments"], "completed")
        self.output.append(item)
        where = {"item_id": item_id, "output_index": index}
        return [self._event("response.output_item.added", output_index=index,
                            item=shape.function_call(item_id, call, "", "in_progress")),
                self._event("response.function_call_arguments.delta", **where,
                            delta=call["arguments"]),
                self._event("response.function_call_arguments.done", **where,
                            arguments=call["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _error(self, error: ErrorEvent) -> list[Event]:
        self.final = shape.final_of_error(error, self._output_now("incomplete"))
        return [self._ending()]

    def _ending(self) -> Event:
        assert self.final is not None
        return self._event(_TERMINAL[self.final.status], response=self.response())

    def _output_now(self, open_status: str = "in_progress") -> list[dict[str, Any]]:
        """The output items, the one still streaming with its text so far."""
        output = list(self.output)
        opened = self._open
        if opened is not None and self.final is None:
            output[opened.index] = _item(opened, "".join(opened.pieces), open_status)
        return output

    def _snapshot(self, status: str) -> dict[str, Any]:
        return shape.response_object(self.stored, status, [])

    def _event(self, kind: str, **data: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return event


def _item(opened: _Open, text: str | None, status: str) -> dict[str, Any]:
    if opened.kind == "message":
        return shape.message(opened.item_id, text, status)
    return shape.reasoning(opened.item_id, text, status)


def _part(kind: str, text: str) -> dict[str, Any]:
    return shape.text_part(text) if kind == "message" else shape.reasoning_part(text)


def _logprobs(kind: str) -> dict[str, Any]:
    return {"logprobs": []} if kind == "message" else {}
