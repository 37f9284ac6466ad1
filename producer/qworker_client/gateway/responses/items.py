"""A response's input as items (kept, listed by `input_items`) and as the chat job's messages.

Input is a string (one user message) or a list of items: messages (`role` user, system,
developer or assistant, `content` a string or text parts), the model's `function_call` items
given back, and `function_call_output` items (a tool's result); `reasoning` items are taken and
not sent to the model. A run of function calls becomes one assistant message with `tool_calls`
(joined to the assistant message before it), each result a `tool` message (`tool_fields`).
"""

from __future__ import annotations

import uuid
from typing import Any

from qworker_client.gateway.errors import bad_request
from qworker_client.gateway.responses import tool_fields
from qworker_client.protocol import MAX_MESSAGES

Item = dict[str, Any]
Message = dict[str, Any]

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
MAX_INPUT_ITEMS = MAX_MESSAGES


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def input_items(given: Any) -> list[Item]:
    """The request's `input` as items in the API's shape, each with an id."""
    if isinstance(given, str):
        return [_message_item("user", given)]
    if not isinstance(given, list) or not given:
        raise bad_request("`input` must be a string or a non-empty list of items", param="input")
    if len(given) > MAX_INPUT_ITEMS:
        raise bad_request(f"`input` may hold at most {MAX_INPUT_ITEMS} items, not {len(given)}",
                          param="input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(given)]


def _item(item: Any, param: str) -> Item:
    if not isinstance(item, dict):
        raise bad_request("an input item must be an object", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request("a message's `role` must be user, system, developer or assistant",
                              param=param)
        return _message_item(role, _text(item.get("content"), param), item.get("id"))
    if kind == "function_call":
        call = {k: _string(item, k, param) for k in ("call_id", "name", "arguments")}
        return {"type": "function_call", "id": item.get("id") or new_id("fc"), **call,
                "status": "completed"}
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = _text(output, param)  # a list of text parts
        return {"type": "function_call_output", "id": item.get("id") or new_id("fco"),
                "call_id": _string(item, "call_id", param), "output": output,
                "status": "completed"}
    if kind == "reasoning":
        return {"type": "reasoning", "id": item.get("id") or new_id("rs"), "summary": [],
                "content": item.get("content") or []}
    raise bad_request(f"input items of type {kind!r} are not supported (message, "
                      "function_call, function_call_output)", param=param)


def _message_item(role: str, text: str, item_id: Any = None) -> Item:
    part = ({"type": "output_text", "text": text, "annotations": []} if role == "assistant"
            else {"type": "input_text", "text": text})
    return {"type": "message", "id": item_id if isinstance(item_id, str) else new_id("msg"),
            "role": role, "status": "completed", "content": [part]}


def _string(item: Item, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"`{key}` must be a string", param=param)
    return value


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("`content` must be a string or a list of text parts", param=param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise bad_request("only text content parts are supported", param=param)
        if not isinstance(part.get("text"), str):
            raise bad_request("a text part needs a string `text`", param=param)
        texts.append(part["text"])
    return "".join(texts)


def messages(items: list[Item]) -> list[Message]:
    """Input or output items as the chat job's messages."""
    out: list[Message] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            out.append({"role": _ROLES[item["role"]], "content": text})
        elif kind == "function_call":
            call = tool_fields.chat_call(item)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", []), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(tool_fields.tool_result(item))
    return out
