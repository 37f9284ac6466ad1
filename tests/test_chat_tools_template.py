"""A chat with tools through a template that has a tools section (Qwen2.5's, below) renders as
transformers' `apply_chat_template(messages, tools=...)` renders it: the tools as given, the
history's calls with their arguments as objects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from qworker.engine.chat import render_chat, template_has_tools
from qworker.engine.tool_calls import HERMES, format_of_template
from qworker.model.tokenizer.tokenizer import Tokenizer

QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501  (the template's own lines)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ARGS = {"city": "Paris", "note": "é \"quoted\""}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_tools_section_renders_as_transformers_does(smollm2_path: Path,
                                                      smollm2_tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    as_transformers_takes_it = [
        {**m, "content": m["content"] or "", "tool_calls": [
            {**c, "function": {**c["function"], "arguments": ARGS}} for c in m["tool_calls"]]}
        if m.get("tool_calls") else m for m in CHAT]
    want = hf.apply_chat_template(as_transformers_takes_it, tools=TOOLS,
                                  chat_template=QWEN25_TOOLS, tokenize=False,
                                  add_generation_prompt=True)
    ours = dataclasses.replace(smollm2_tokenizer, chat_template=QWEN25_TOOLS)
    assert template_has_tools(QWEN25_TOOLS) and format_of_template(QWEN25_TOOLS) is HERMES
    assert render_chat(ours, CHAT, TOOLS, HERMES) == want
    assert '"arguments": {"city": "Paris"' in want and "<tool_response>\nsunny" in want
