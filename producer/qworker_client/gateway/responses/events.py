"""A response's stream of events, made from its job's output stream, entry by entry.

The events are a function of the output stream alone (one `response.output_text.delta` per token
event with text, the function calls when the `done` event brings them), so any gateway, at any
time, makes the same events with the same `sequence_number`s: a stream resumed after event N by
another gateway is the rest of the one first sent. Token events seen before (a rollback) and
anything after the job's end are skipped, as `OutputState` takes a stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qworker_client.gateway.responses import shape, tool_fields
from qworker_client.gateway.responses.record import Final, StoredResponse
from qworker_client.protocol import DoneEvent, ErrorEvent, TokenEvent
from qworker_client.result import OutputState

Event = dict[str, Any]
_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
             "cancelled": "response.incomplete", "failed": "response.failed"}


class ResponseEvents:
    def __init__(self, stored: StoredResponse) -> None:
        self.stored = stored
        self.state = OutputState(stored.job_id)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.final: Final | None = None
        self._text: list[str] | None = None  # the open message's text, while it streams
        self._base = stored.id.removeprefix("resp_")  # item ids: the same from any gateway

    @property
    def ended(self) -> bool:
        return self.final is not None

    def status(self) -> str:
        if self.final is not None:
            return self.final.status
        return "cancelled" if self.stored.cancelled else "in_progress"

    def response(self) -> dict[str, Any]:
        """The response object as the events so far make it."""
        return shape.response_object(self.stored, self.status(), self._output_now(), self.final)

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self._snapshot("in_progress")),
                self._event("response.in_progress", response=self._snapshot("in_progress"))]

    def entry(self, entry_id: str, fields: Mapping[str, str]) -> list[Event]:
        """The events of one entry of the job's output stream (none for most kinds)."""
        fields, calls = tool_fields.split_tool_output(dict(fields))
        try:
            event = self.state.apply(entry_id, fields)
        except ValueError as exc:
            if fields.get("type") == "token":
                return []
            event = ErrorEvent(code="bad_event", message=f"unreadable output event: {exc}")
        if isinstance(event, TokenEvent):
            return self._token(event.text) if event.text else []
        if isinstance(event, DoneEvent):
            return self._done(event, shape.tool_calls(calls))
        if isinstance(event, ErrorEvent):
            return self._error(event)
        return []

    def ended_as(self, final: Final) -> list[Event]:
        """The end kept in the record, for a response whose output stream has expired first:
        its events are not made again, only its terminal one."""
        self.final = final
        self.output = list(final.output)
        return [self._ending()]

    def _token(self, text: str) -> list[Event]:
        events = [] if self._text is not None else self._open_message()
        assert self._text is not None
        self._text.append(text)
        return [*events, self._event("response.output_text.delta", **self._at(), delta=text,
                                     logprobs=[])]

    def _open_message(self) -> list[Event]:
        self._text = []
        index = len(self.output)
        self.output.append(shape.message(self._message_id, None, "in_progress"))
        return [self._event("response.output_item.added", output_index=index,
                            item=shape.message(self._message_id, None, "in_progress")),
                self._event("response.content_part.added", **self._at(),
                            part=shape.text_part(""))]

    def _done(self, done: DoneEvent, calls: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        if self._text is not None or done.text:
            events += self._close_message(done.text)
        for k, call in enumerate(calls):
            events += self._call(k, call)
        reason = "tool_calls" if calls else done.finish_reason
        completed_at = self.stored.created_at + round(done.total_ms / 1000)  # any gateway's
        self.final = shape.final_of_done(done, reason, list(self.output), completed_at)
        return [*events, self._ending()]

    def _close_message(self, text: str) -> list[Event]:
        events = [] if self._text is not None else self._open_message()
        if not self._text and text:
            events.append(self._event("response.output_text.delta", **self._at(), delta=text,
                                      logprobs=[]))
        self._text = None
        where = self._at()
        item = shape.message(self._message_id, text, "completed")
        self.output[where["output_index"]] = item
        return [*events,
                self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=shape.text_part(text)),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=item)]

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
        """The output items, the message still streaming with its text so far."""
        if self._text is None or self.final is not None:
            return list(self.output)
        where = self._at()["output_index"]
        output = list(self.output)
        output[where] = shape.message(self._message_id, "".join(self._text), open_status)
        return output

    def _snapshot(self, status: str) -> dict[str, Any]:
        return shape.response_object(self.stored, status, [])

    @property
    def _message_id(self) -> str:
        return f"msg_{self._base}"

    def _at(self) -> dict[str, Any]:
        """Where the open message's text part is."""
        index = next(i for i, item in enumerate(self.output) if item["id"] == self._message_id)
        return {"item_id": self._message_id, "output_index": index, "content_index": 0}

    def _event(self, kind: str, **data: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return event
