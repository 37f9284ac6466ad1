"""Chat completions with tools through the gateway, with the official `openai` SDK, a real
worker and a real redis-server: calls returned and streamed as OpenAI streams them (id, type and
name first with empty arguments, then the arguments in pieces), `finish_reason: tool_calls`,
and the agent loop's turn that sends the call and its result back. On the simulated engine (its
byte model writes whatever the call grammar allows). The agent loop on the default model is in
tests/test_tool_calls_engine.py (beside that model, loaded once)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import redis
from openai import OpenAI

from tests.gateway_harness import gateway, live_worker
from tests.service_harness import check_stream

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False},
    "strict": True}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture
def sdk(redis_url: str) -> Any:
    with live_worker(redis_url, "gw-tools"), gateway(redis_url) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_required_calls_come_back_parsed_and_valid(sdk: OpenAI, redis_url: str) -> None:
    got = sdk.chat.completions.create(model="sim", messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice="required", max_tokens=400, seed=1)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        valid(call.function.name, call.function.arguments)
    done = check_stream(redis.Redis.from_url(redis_url), got.id)  # the job's own events agree
    assert [c.model_dump() for c in done.tool_calls or ()] == [
        c.model_dump() for c in choice.message.tool_calls]


def test_streamed_calls_come_as_openai_streams_them(sdk: OpenAI) -> None:
    chunks = list(sdk.chat.completions.create(
        model="sim", messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=400, seed=2, stream=True))
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or ():
            if d.index not in calls:  # a call's first delta: id, type, name, empty arguments
                assert d.id and d.type == "function" and d.function and d.function.name
                assert d.function.arguments == ""
                calls[d.index] = {"name": d.function.name, "arguments": "", "pieces": 0}
            else:
                assert d.id is None and d.function and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
                calls[d.index]["pieces"] += 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert sorted(calls) == [0]
    for call in calls.values():
        assert call["name"] == "get_weather" and call["pieces"] > 1  # in pieces, as it came
        valid(call["name"], call["arguments"])


def test_bad_tools_are_one_line_400s(sdk: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        sdk.chat.completions.create(model="sim", messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "function",
                                                 "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tools"):
        sdk.chat.completions.create(model="sim", messages=ASK,
                                    tools=[{"type": "web_search"}])  # type: ignore[list-item]
