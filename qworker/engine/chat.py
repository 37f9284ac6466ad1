"""The text on the way in: a job's prompt (text, chat messages with tools, or token ids) as the
token ids the engine runs. The engine's front door owns it, beside the detokenizer and the output
parsers (docs/architecture.md "One owner of text").

Chats render through the model's own template, as transformers' `apply_chat_template` does. With
tools (or a history that holds tool calls and results), a template that has a tools section
(one that reads `tools`) gets them as transformers passes them: `tools=[...]`, assistant
`tool_calls` with their arguments as objects. A template without one gets the generic fallback:
the tools described in a system message in Hermes' words, earlier calls written as the model
would write them, tool results as user turns in `<tool_response>` tags (docs/engine.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from qworker.engine.tool_calls import ToolFormat

Message = Mapping[str, Any]


_GENERIC_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@lru_cache(maxsize=8)
def template_has_tools(template: str | None) -> bool:
    """The template reads a `tools` variable (its own tools section)."""
    if not template:
        return False
    from jinja2 import Environment, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))
    except Exception:  # a template jinja2 cannot parse alone: it has no section we can use
        return False


def render_chat(tokenizer: Any, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                fmt: ToolFormat) -> str:
    """The chat as the prompt text the model continues."""
    if not tools and not any(_speaks_of_tools(m) for m in messages):
        return str(tokenizer.apply_chat_template([_plain(m) for m in messages]))
    if template_has_tools(getattr(tokenizer, "chat_template", None)):
        kwargs = {"tools": list(tools)} if tools else {}
        return str(tokenizer.apply_chat_template([_for_template(m) for m in messages], **kwargs))
    return str(tokenizer.apply_chat_template(generic_messages(messages, tools, fmt)))


def generic_messages(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                     fmt: ToolFormat) -> list[Message]:
    """Plain role/content messages that say what a tools section would (the fallback)."""
    out = [_generic(m, fmt) for m in messages]
    if tools:
        section = _GENERIC_TOOLS.format(tools="\n".join(
            json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _speaks_of_tools(message: Message) -> bool:
    return message["role"] == "tool" or bool(message.get("tool_calls"))


def _plain(message: Message) -> Message:
    return {"role": message["role"], "content": message.get("content") or ""}


def _for_template(message: Message) -> Message:
    """transformers' shape: arguments as objects (templates `tojson` them), content a string."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = message.get("content") or ""
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"],
                                                "arguments": _arguments(c["function"])}}
                             for c in message["tool_calls"]]
    return out


def _arguments(function: dict[str, Any]) -> Any:
    text = function.get("arguments", "{}")
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text  # not JSON: the template gets what was sent


def _generic(message: Message, fmt: ToolFormat) -> Message:
    if message["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    content = message.get("content") or ""
    calls = [fmt.render_call(c["function"]["name"], c["function"].get("arguments") or "{}")
             for c in message.get("tool_calls") or ()]
    if calls:
        content = "\n".join(filter(None, (content, *calls)))
    return {"role": message["role"], "content": content}
