"""Tools on the wire as a redis-cli producer writes them (every value a string), through a real
worker and redis-server: the calls on `done`, their deltas on token events, bad fields refused in
one line; a resumed job's calls are the same calls with the same ids; thinking and calls shaped
as OpenAI's chat messages and deltas."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from qworker.engine.config import EngineConfig
from qworker.engine.request import Prompt, Request, SamplingParams, ToolCalling
from qworker.engine.simulated import SimulatedEngine, run_offline
from qworker_client import Producer
from qworker_client.gateway.chat import shaping
from qworker_client.protocol import DoneEvent, ErrorEvent, TokenEvent, ToolCall
from qworker_client.result import result_fields
from tests.service_harness import check_stream, events, submit, thread_worker, wait_terminal

SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {
    "q": {"enum": ["cats", "dogs"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["q", "n"], "additionalProperties": False}}
TOOLS = json.dumps([{"type": "function", "function": SEARCH}])
MESSAGES = json.dumps([{"role": "user", "content": "find cats"}])


def test_a_redis_cli_job_with_tools_gets_its_calls(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    named = json.dumps({"type": "function", "function": {"name": "search"}})
    history = json.dumps([
        {"role": "user", "content": "find cats"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "search", "arguments": '{"q":"cats","n":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 cats"}])
    with thread_worker(redis_url, "w-tools"):
        submit(client, "t-req", messages=MESSAGES, tools=TOOLS, tool_choice="required",
               parallel_tool_calls="false", max_tokens=200)
        submit(client, "t-named", messages=history, tools=TOOLS, tool_choice=named,
               parallel_tool_calls="false", max_tokens=200)
        submit(client, "t-bad", messages=MESSAGES, tools=TOOLS, tool_choice="sometimes")
        submit(client, "t-bad2", prompt="hi", tools=TOOLS)
        ends = wait_terminal(client, ["t-req", "t-named", "t-bad", "t-bad2"])
        with Producer(redis_url) as producer:  # the Python client gets them too
            result = producer.submit(messages=json.loads(MESSAGES), tools=json.loads(TOOLS),
                                     tool_choice="required", parallel_tool_calls=False,
                                     max_tokens=200).result(30)
    assert result.finish_reason == "tool_calls" and result.tool_calls
    assert json.loads(json.dumps(result_fields(result)))["tool_calls"][0]["type"] == "function"
    for job_id in ("t-req", "t-named"):
        done = check_stream(client, job_id)  # joined token texts are the answer
        assert done.finish_reason == "tool_calls" and done.tool_calls
        rebuilt = rebuild([e for e in events(client, job_id) if isinstance(e, TokenEvent)])
        assert rebuilt == [c.model_dump() for c in done.tool_calls]
        for call in done.tool_calls:
            args = json.loads(call.function.arguments)
            assert args["q"] in ("cats", "dogs") and 1 <= args["n"] <= 9
    assert len(ends["t-named"].tool_calls or ()) == 1  # type: ignore[union-attr]
    for job_id, says in (("t-bad", "tool_choice"), ("t-bad2", "tools go with `messages`")):
        bad = ends[job_id]
        assert isinstance(bad, ErrorEvent) and bad.code == "invalid_request"
        assert says in bad.message and "\n" not in bad.message


def rebuild(tokens: list[TokenEvent]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for token in tokens:
        for d in token.tool_calls or ():
            if "id" in d:
                calls[d["index"]] = {"id": d["id"], "type": d["type"], "function": {
                    "name": d["function"]["name"], "arguments": ""}}
            calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_a_resumed_job_makes_the_same_calls_with_the_same_ids() -> None:
    engine = SimulatedEngine(EngineConfig(model="sim:step_ms=0", num_blocks=512))
    prompt = engine.encode(Prompt(messages=({"role": "user", "content": "go"},),
                                  tools=({"type": "function", "function": SEARCH},)))
    tools = ToolCalling((SEARCH,), "required")
    params = SamplingParams(max_tokens=200, seed=5)
    whole = run_offline(engine, [Request("j", prompt, params, tools=tools)])["j"]
    for cut in (3, len(whole.token_ids) // 2, len(whole.token_ids) - 1):
        engine.add(Request("j", prompt, params, output_token_ids=whole.token_ids[:cut],
                           tools=tools))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert outs[-1].finish_reason == "tool_calls"
        assert outs[-1].tool_calls and outs[-1].tool_calls == first_calls(engine, prompt, params,
                                                                          tools)


def first_calls(engine: SimulatedEngine, prompt: list[int], params: SamplingParams,
                tools: ToolCalling) -> list[dict[str, Any]]:
    engine.add(Request("j", prompt, params, tools=tools))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs[-1].tool_calls or []


def test_thinking_and_calls_are_shaped_as_openai_s() -> None:
    call = ToolCall.model_validate({"id": "call_1", "type": "function", "function": {
        "name": "search", "arguments": '{"q":"cats"}'}})
    done = DoneEvent(finish_reason="tool_calls", text="\n", prompt_tokens=1, completion_tokens=2,
                     tool_calls=[call], reasoning="they want cats")
    assert shaping.message(done) == {"role": "assistant", "content": None,
                                     "tool_calls": [call.model_dump()],
                                     "reasoning_content": "they want cats"}
    shape = shaping.Shape("chat", "chatcmpl-1", "m", 0)
    delta = [{"index": 0, "id": "call_1", "type": "function",
              "function": {"name": "search", "arguments": ""}}]
    chunk = shaping.rich_chunk(shape, 0, "", True, None, "hmm", delta)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "hmm",
                                            "tool_calls": delta}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_every_format_s_grammar_writes_calls_its_parser_reads(parser: str) -> None:
    """Required (two calls allowed) and auto with the format's opening written: each output,
    written under that format's call grammar, parses back to valid calls."""
    engine = SimulatedEngine(EngineConfig(model="sim:step_ms=0", num_blocks=512,
                                          tool_call_parser=parser))
    prompt = engine.encode(Prompt(messages=({"role": "user", "content": "go"},),
                                  tools=({"type": "function", "function": SEARCH},)))
    opening = {"hermes": "Sure. <tool_call>", "llama3_json": " {",
               "mistral": "[TOOL_CALLS]"}[parser]
    requests = [
        Request("required", prompt, SamplingParams(max_tokens=300, seed=1),
                tools=ToolCalling((SEARCH,), "required", parallel=False)),
        Request("auto", prompt, SamplingParams(max_tokens=300, seed=2),
                output_token_ids=list(opening.encode()),
                tools=ToolCalling((SEARCH,), "auto", parallel=False)),
    ]
    outs: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add(r)
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    for rid, got in outs.items():
        done = got[-1]
        assert done.finish_reason == "tool_calls", (parser, rid, done)
        for call in done.tool_calls or []:
            args = json.loads(call["function"]["arguments"])
            assert args["q"] in ("cats", "dogs") and 1 <= args["n"] <= 9
