"""A `POST /v1/responses` body, checked, as what the response object shows and the chat job's
fields. The fields' values are judged by the protocol at submit, as for chat completions; here
only the Responses shape is, and what is not supported is refused with a clear 400."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qworker_client.gateway.chat.structured import structured_outputs
from qworker_client.gateway.errors import bad_request
from qworker_client.gateway.responses import items, shape, tool_fields
from qworker_client.protocol import MAX_MESSAGES

_UNSUPPORTED = ("conversation", "prompt", "max_tool_calls")
MAX_METADATA = 16


@dataclass(frozen=True)
class Create:
    model: str
    input: list[items.Item]
    instructions: str | None
    stream: bool
    background: bool
    store: bool
    previous_response_id: str | None
    shown: dict[str, Any]  # the response object's fields from the request
    job: dict[str, Any]  # the chat job's fields, but for `id` and `messages`

    def messages(self, history: list[items.Message]) -> list[items.Message]:
        """The job's messages: the instructions, the chain's messages, then this input."""
        system = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}]
        found = [*system, *history, *items.messages(self.input)]
        if len(found) > MAX_MESSAGES:
            raise bad_request(f"the conversation holds {len(found)} messages, more than "
                              f"{MAX_MESSAGES}: start a new one", param="previous_response_id"
                              if history else "input")
        return found


def parse_create(body: Any) -> Create:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required", param="model")
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise bad_request(f"`{name}` is not supported", param=name)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("`instructions` must be a string", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("`previous_response_id` must be a string",
                          param="previous_response_id")
    store, background = _flag(body, "store", True), _flag(body, "background", False)
    if background and not store:
        raise bad_request("a background response must be stored (`store` true)",
                          param="background")
    tools = body.get("tools") or []
    chat_tools = tool_fields.chat_tools(tools)
    names = [tool["function"]["name"] for tool in chat_tools]
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("`parallel_tool_calls` must be a boolean", param="parallel_tool_calls")
    effort = tool_fields.effort(body.get("reasoning"))
    text = body.get("text") or {"format": {"type": "text"}}
    job = {
        "model": model, "max_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "structured_outputs": structured_outputs(
            {"response_format": shape.text_format(text)}),
        # TOOL FIELDS: the wire's tool fields (docs/protocol.md), set only when asked; all of
        # their conversion is in tool_fields.py, the one place to change on the wire's side
        **tool_fields.job_tool_fields(chat_tools, tool_fields.chat_tool_choice(choice, names),
                                      parallel, effort),
    }
    shown = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": previous, "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "tool_choice": "auto" if choice is None else choice,
        "tools": tools, "text": text, "metadata": _metadata(body.get("metadata")),
        "reasoning": None if effort is None else {"effort": effort, "summary": None},
        "truncation": "disabled", "user": body.get("user"),
    }
    return Create(model=model, input=items.input_items(body.get("input")),
                  instructions=instructions, stream=_flag(body, "stream", False),
                  background=background, store=store, previous_response_id=previous,
                  shown=shown, job=job)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"`{name}` must be a boolean", param=name)
    return value


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                       and len(v) <= 512 for k, v in value.items())):
        raise bad_request(f"`metadata` must map at most {MAX_METADATA} keys (64 characters) to "
                          "strings (512 characters)", param="metadata")
    return value
