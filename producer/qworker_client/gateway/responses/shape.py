"""The response object and its output items, in the shapes of the `openai` SDK's
`types/responses` (`Response`, `ResponseOutputMessage`, `ResponseFunctionToolCall`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qworker_client.gateway.errors import bad_request
from qworker_client.gateway.responses.record import Final, StoredResponse
from qworker_client.protocol import DoneEvent, ErrorEvent, ToolCall

# a job's finish reason as the response's end: its status and incomplete_details' reason
_ENDS: dict[str, tuple[str, str | None]] = {
    "stop": ("completed", None), "tool_calls": ("completed", None),
    "length": ("incomplete", "max_output_tokens"), "cancelled": ("cancelled", None),
    "timeout": ("incomplete", None),
}
_INVALID = ("invalid_request", "prompt_too_long")


def response_object(stored: StoredResponse, status: str, output: list[dict[str, Any]],
                    final: Final | None = None) -> dict[str, Any]:
    """The response as the API returns it: `final`'s state once ended, else `status` and the
    output so far."""
    if final is not None:
        status, output = final.status, final.output
    return {
        "id": stored.id, "object": "response", "created_at": stored.created_at,
        "status": status, "background": stored.background,
        "error": None if final is None else final.error,
        "incomplete_details": None if final is None else final.incomplete_details,
        "model": stored.model, "output": output,
        "usage": None if final is None else final.usage,
        "completed_at": None if final is None else final.completed_at,
        "store": stored.store, **stored.request,
    }


def message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message item; `text` None: no content part yet."""
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning item: the model's thinking, as its `reasoning_text` content."""
    content = [] if text is None else [reasoning_part(text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call(item_id: str, call: dict[str, Any], arguments: str, status: str
                  ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["name"], "arguments": arguments, "status": status}


def tool_calls(calls: Sequence[ToolCall] | None) -> list[dict[str, Any]]:
    """A done event's `tool_calls` as `{"id", "name", "arguments"}`."""
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in calls or ()]


def usage(done: DoneEvent, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def final_of_done(done: DoneEvent, finish_reason: str, output: list[dict[str, Any]],
                  completed_at: int, reasoning_tokens: int = 0) -> Final:
    status, reason = _ENDS.get(finish_reason, ("completed", None))
    return Final(status=status, output=output, usage=usage(done, reasoning_tokens),
                 incomplete_details=None if reason is None else {"reason": reason},
                 completed_at=completed_at)


def final_of_error(error: ErrorEvent, output: list[dict[str, Any]]) -> Final:
    code = "invalid_prompt" if error.code in _INVALID else "server_error"
    return Final(status="failed", output=output, usage=None,
                 error={"code": code, "message": f"{error.code}: {error.message}"})


def text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as a chat `response_format` (for `chat.structured`); None: plain text."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("`text.format.schema` must be a JSON Schema object",
                              param="text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                       "schema": fmt["schema"]}}
    raise bad_request("`text.format.type` must be text, json_object or json_schema",
                      param="text.format")
