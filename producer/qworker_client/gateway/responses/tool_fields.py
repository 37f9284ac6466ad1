"""The Responses API's tools as the job's tool fields: the one place they are passed on.

The wire's tool fields (docs/protocol.md: `tools`, `tool_choice`, `parallel_tool_calls`,
`reasoning_effort`; assistant messages with `tool_calls` and `tool` messages in `messages`) are
the chat API's: OpenAI's chat-style function tools `{"type": "function", "function": {...}}`.
The Responses API writes them flat (`{"type": "function", "name", ...}`), so they are converted
here, and nowhere else. A client whose wire schema predates the tool fields refuses them at
submit (a 400 naming the field); requests without tools never set them.
"""

from __future__ import annotations

import json
from typing import Any

from qworker_client.gateway.errors import bad_request

MAX_TOOLS = 128
_CHOICES = ("none", "auto", "required")
_EFFORTS = ("minimal", "low", "medium", "high")


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools` (flat function tools) as chat-style function tools."""
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"`tools` must be a list of at most {MAX_TOOLS} tools", param="tools")
    return [_chat_tool(tool, i) for i, tool in enumerate(tools)]


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request("only function tools are supported", param=param)
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("a function tool needs a `name`", param=param)
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request("`parameters` must be a JSON Schema object", param=param)
    function: dict[str, Any] = {"name": name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any, names: list[str]) -> str | dict[str, Any] | None:
    """`tool_choice` (`none` | `auto` | `required` | `{"type": "function", "name"}`) as the
    wire's (the named form chat-style)."""
    if choice is None or choice in _CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in names:
            raise bad_request(f"`tool_choice` names a function not in `tools`: {name!r}",
                              param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise bad_request("`tool_choice` must be none, auto, required or a named function",
                      param="tool_choice")


def job_tool_fields(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None,
                    parallel: bool | None, effort: str | None) -> dict[str, Any]:
    """The job's tool fields: only those the request set (a request without tools sets none)."""
    fields: dict[str, Any] = {}
    if tools:
        fields["tools"] = json.dumps(tools, separators=(",", ":"))
    if choice is not None and tools:
        fields["tool_choice"] = choice if isinstance(choice, str) else json.dumps(choice)
    if parallel is not None and tools:
        fields["parallel_tool_calls"] = parallel
    if effort is not None:
        fields["reasoning_effort"] = effort
    return fields


def effort(reasoning: Any) -> str | None:
    """`reasoning.effort` (the job's `reasoning_effort`); None when not given."""
    if reasoning is None:
        return None
    value = reasoning.get("effort") if isinstance(reasoning, dict) else reasoning
    if value is None:
        return None
    if value not in _EFFORTS:
        raise bad_request(f"`reasoning.effort` must be one of {', '.join(_EFFORTS)}",
                          param="reasoning")
    return str(value)


def chat_call(item: dict[str, Any]) -> dict[str, Any]:
    """A `function_call` item (the model's, given back) as one of a chat assistant message's
    `tool_calls`."""
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def tool_result(item: dict[str, Any]) -> dict[str, Any]:
    """A `function_call_output` item as a chat `tool` message."""
    return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
