"""Tool calls on the default model (SmolLM2-135M-Instruct, which has no tools section: the
generic fallback renders them): with tool_choice required or named, every call parses and its
arguments validate against the function's schema; in auto, once a call is opened mid-text the
rest of it is a valid call. Thinking on a random-weight model whose template thinks: split off,
and its end forced at the budget. An agent loop through the gateway with the openai SDK."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.request import Prompt, Request, SamplingParams, StepOutput, ToolCalling
from qworker.model.decoder import load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from tests.engine_fixtures import tiny_engine, tiny_model
from tests.gateway_harness import gateway, live_worker

ASK = ({"role": "system", "content": "Call a tool."}, {"role": "user", "content": "Go."})


@pytest.fixture(scope="module")
def engine(smollm2_path: Path, smollm2_tokenizer: Tokenizer) -> Engine:
    return Engine(load_model(smollm2_path, dtype=torch.float32), smollm2_tokenizer,
                  EngineConfig(num_blocks=768, block_size=16, max_num_seqs=64))


def run(engine: Engine, requests: list[Request]) -> dict[str, list[StepOutput]]:
    outs: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add(r)
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


# small schemas, so that a call fits in few tokens: the CPU decodes about 50 tokens a second
names = st.from_regex(r"[a-z][a-z_]{0,3}", fullmatch=True)
leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 3)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(names, min_size=1, max_size=3, unique=True)),
    st.builds(lambda n: {"type": "array", "items": {"type": "integer"}, "maxItems": n},
              st.integers(0, 2)),
)
parameters = st.dictionaries(names, leaf, min_size=1, max_size=2).flatmap(
    lambda props: st.builds(lambda req: {"type": "object", "properties": props,
                                         "required": sorted(req),
                                         "additionalProperties": False},
                            st.sets(st.sampled_from(sorted(props)))))
function = st.builds(lambda name, params: {"name": name, "description": f"does {name}",
                                           "parameters": params}, names, parameters)
toolsets = st.lists(function, min_size=1, max_size=2, unique_by=lambda f: f["name"])

REQUESTS = 64  # random schemas, each a request, all in one batch (200 take 3 minutes here)
RENDERED = 4  # of which these few have their tools in the prompt; the rest share a cached one
PLAIN = ({"role": "user", "content": "Call a function."},)


# one example, not shrunk (each try decodes the whole batch): a failure shows every schema
@settings(max_examples=1, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(toolsets, st.booleans()), min_size=REQUESTS, max_size=REQUESTS))
def test_required_named_and_opened_calls_always_parse_and_validate(
        engine: Engine, cases: list[tuple[list[dict[str, Any]], bool]]) -> None:
    """The call's grammar, not the prompt, makes it valid: past the first few, the requests
    share one short prompt (its KV cached once) so that the CPU decodes rather than prefills."""
    plain = engine.encode(Prompt(messages=PLAIN))
    requests = []
    for k, (functions, named) in enumerate(cases):
        choice = functions[-1]["name"] if named else "required"
        tools = tuple({"type": "function", "function": f} for f in functions)
        ids = engine.encode(Prompt(messages=ASK, tools=tools)) if k < RENDERED else plain
        requests.append(Request(f"r{k}", ids, SamplingParams(max_tokens=40, temperature=1.0,
                                                             seed=k),
                                tools=ToolCalling(tuple(functions), choice, parallel=k % 8 == 0)))
    outs = run(engine, [*requests, opened_call(engine)])  # one batch: the CPU is scarce
    check_opened_call(outs["auto"][-1])
    finished = 0
    for (functions, named), r in zip(cases, requests, strict=True):
        done = outs[r.request_id][-1]
        if done.finish_reason == "length":  # cut at max_tokens: the calls it finished still parse
            calls = [c for c in done.tool_calls or [] if _parses(c["function"]["arguments"])]
        else:
            assert done.finish_reason == "tool_calls", done
            calls = done.tool_calls or []
            assert calls
            finished += 1
        schemas = {f["name"]: f["parameters"] for f in functions}
        for call in calls:
            name = call["function"]["name"]
            assert name in schemas and (not named or name == functions[-1]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
        assert (r.tools is not None and r.tools.parallel) or len(calls) <= 1
    assert finished >= 0.9 * REQUESTS, f"only {finished} of {REQUESTS} calls ended in time"


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}


def opened_call(engine: Engine) -> Request:
    """tool_choice auto, the model having opened a call mid-text (its earlier tokens replayed,
    as a resumed job's are): the rest must be a valid call."""
    ids = engine.encode(Prompt(messages=ASK, tools=({"type": "function", "function": WEATHER},)))
    opened = engine.tokenizer.encode("Let me check the weather. <tool_call>\n")
    return Request("auto", ids, SamplingParams(max_tokens=64, temperature=1.0, seed=0),
                   output_token_ids=opened, tools=ToolCalling((WEATHER,), "auto",
                                                              parallel=False))


def check_opened_call(done: StepOutput) -> None:
    assert done.finish_reason == "tool_calls", done
    assert done.text == "Let me check the weather. "
    (call,) = done.tool_calls or []
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["parameters"])


def test_the_generic_fallback_renders_tools_and_history(engine: Engine) -> None:
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
    chat = (*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"})
    text = engine.tokenizer.decode(engine.encode(Prompt(messages=chat, tools=tools)))
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' in text
    assert "<tool_response>\n42\n</tool_response>" in text


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                     "<|im_end|>\n{% endfor %}<|im_start|>assistant\n<think>\n"
                     "{# a model that thinks: its answer follows </think> #}")


def test_thinking_is_split_off_and_its_end_forced_at_the_budget(
        smollm2_tokenizer: Tokenizer) -> None:
    tokenizer = dataclasses.replace(smollm2_tokenizer, chat_template=THINKING_TEMPLATE)
    engine = tiny_engine(tokenizer, tiny_model(tokenizer.vocab_size, torch.float32))
    ids = engine.encode(Prompt(messages=ASK))
    r = Request("t", ids, SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True),
                max_reasoning_tokens=6)
    outs = run(engine, [r])["t"]
    done = outs[-1]
    generated = tokenizer.decode([t for o in outs for t in o.new_token_ids])
    thought, _, answer = generated.partition("</think>")
    assert "</think>" in generated and len(tokenizer.encode(thought)) <= 8
    assert done.reasoning == "".join(o.reasoning_delta for o in outs) == thought
    assert done.text == "".join(o.text_delta for o in outs) == answer.lstrip()


WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {**WEATHER, "strict": True}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris for two days?"}]


def test_an_agent_loop_through_the_gateway(redis_url: str, engine: Engine) -> None:
    """Call a tool (forced: the 135M model would not on its own), send the call and its
    result back, get an answer."""
    with live_worker(redis_url, "gw-agent", engine, model="smollm2"), \
            gateway(redis_url) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as sdk:
        first = sdk.chat.completions.create(
            model="smollm2", messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
            parallel_tool_calls=False, max_tokens=48, temperature=0)
        (call,) = first.choices[0].message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
        sent_back = first.choices[0].message.model_dump(exclude_none=True)
        history: list[Any] = [*ASK_WEATHER, sent_back, {"role": "tool", "tool_call_id": call.id,
                               "content": json.dumps({"forecast": "sunny", "celsius": 21})}]
        answer = sdk.chat.completions.create(model="smollm2", messages=history,
                                             tools=[WEATHER_TOOL], max_tokens=16, temperature=0)
    message = answer.choices[0].message
    assert message.content and not message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_thinking_streams_as_reasoning_content_through_the_gateway(
        redis_url: str, smollm2_tokenizer: Tokenizer) -> None:
    tokenizer = dataclasses.replace(smollm2_tokenizer, chat_template=THINKING_TEMPLATE)
    engine = tiny_engine(tokenizer, tiny_model(tokenizer.vocab_size, torch.float32))
    with live_worker(redis_url, "gw-think", engine, model="thinker"), \
            gateway(redis_url) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        chunks = list(sdk.chat.completions.create(
            model="thinker", messages=list(ASK), max_tokens=20, seed=4, stream=True,
            reasoning_effort="low", extra_body={"max_reasoning_tokens": 5, "ignore_eos": True}))
        whole = sdk.chat.completions.create(
            model="thinker", messages=list(ASK), max_tokens=20, seed=4,
            extra_body={"max_reasoning_tokens": 5, "ignore_eos": True})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.content or "" for d in deltas)
    message = whole.choices[0].message
    assert thought and thought == (message.model_extra or {})["reasoning_content"]
    assert answer == message.content and "</think>" not in answer + thought
