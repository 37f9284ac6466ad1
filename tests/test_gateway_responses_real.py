"""`/v1/responses` on the real default model (SmolLM2) through the official `openai` SDK, over two
gateways: one a process of its own, killed with SIGKILL while it streams a background response,
the other serving that response's stream from the event after the last one seen, the chain of
`previous_response_id`, a cancel, and a function call made, answered and talked about."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.model.decoder import load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker_client.local_redis import free_port
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import ROOT, wait_for

MODEL = "smollm2"
QUESTION = "Name a colour."



@pytest.fixture
def process_gateway(redis_url: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`qworker gateway` as a process: (the process, its base URL), once it is ready."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "producer")])}
    proc = subprocess.Popen([sys.executable, "-m", "qworker_client", "gateway", "--redis-url",
                             redis_url, "--port", str(port), "--log-level", "warning"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "ready" in proc.stdout.readline()
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()


def test_responses_on_the_default_model_across_two_gateways(
        redis_url: str, smollm2_path: Path, smollm2_tokenizer: Tokenizer,
        process_gateway: tuple[subprocess.Popen[str], str]) -> None:
    engine = Engine(load_model(smollm2_path), smollm2_tokenizer,
                    EngineConfig(max_num_seqs=4, num_blocks=256))
    proc, a_url = process_gateway
    with live_worker(redis_url, "resp-real", engine, model=MODEL), gateway(redis_url) as b_url, \
            OpenAI(base_url=f"{a_url}/v1", api_key="u", max_retries=0, timeout=120) as a, \
            OpenAI(base_url=f"{b_url}/v1", api_key="u", max_retries=0, timeout=120) as b:
        # greedy: the whole response is its stream's text
        whole = a.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12,
                                   temperature=0)
        events = list(a.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12,
                                         temperature=0, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == whole.output_text != ""
        assert events[-1].type in ("response.completed", "response.incomplete")

        # text.format: JSON that follows its schema, through the structured-output engine
        schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
                  "required": ["colour"], "additionalProperties": False}
        shaped = a.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, text={
            "format": {"type": "json_schema", "name": "colour", "schema": schema}})
        assert json.loads(shaped.output_text)["colour"] in ("red", "blue")

        # the other gateway continues the conversation: the model sees it all
        second = b.responses.create(model=MODEL, input="Another one.", max_output_tokens=6,
                                    temperature=0, previous_response_id=whole.id)
        seen = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": whole.output_text},
                {"role": "user", "content": "Another one."}]
        assert second.usage is not None
        assert second.usage.input_tokens == len(smollm2_tokenizer.encode_chat(seen))

        # a background response outlives the gateway streaming it: the other one streams the rest
        stream = a.responses.create(model=MODEL, input="Tell me a story.", background=True,
                                    stream=True, max_output_tokens=120, temperature=0)
        first = []
        for event in stream:
            first.append(event)
            if len(first) == 6:  # created, in_progress, item, part, two deltas
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        response_id = first[0].response.id  # type: ignore[union-attr]
        rest = list(b.responses.retrieve(response_id, stream=True,
                                         starting_after=first[-1].sequence_number))
        assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
        text = "".join(e.delta for e in first + rest  # type: ignore[union-attr]
                       if e.type == "response.output_text.delta")
        ended = b.responses.retrieve(response_id)
        assert ended.status == "incomplete" and ended.output_text == text
        assert ended.usage is not None and ended.usage.output_tokens == 120
        assert any(e.type == "response.output_text.delta" for e in rest)

        # a background response cancelled while it runs
        long = b.responses.create(model=MODEL, input="Count to a thousand.", background=True,
                                  max_output_tokens=2000)
        wait_for(lambda: b.responses.retrieve(long.id).output_text, timeout=60,
                 what="its first text")
        assert b.responses.cancel(long.id).status == "cancelled"
        done = wait_for(lambda: (r := b.responses.retrieve(long.id)).completed_at and r,
                        timeout=60, what="its end")
        assert done.status == "cancelled" and done.usage is not None
        assert done.usage.output_tokens < 2000

        # function tools: a required call of an allowed function whose arguments follow its
        # schema (the call grammar), then its output sent back, and an answer in words
        city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"], "additionalProperties": False}
        weather = {"type": "function", "name": "get_weather", "strict": True,
                   "description": "The weather in a city", "parameters": city}
        called = b.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[weather], tool_choice="required",  # type: ignore[list-item]
                                    max_output_tokens=40, temperature=0)
        calls = [item for item in called.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather"
        assert set(json.loads(calls[0].arguments)) == {"city"}
        answer = b.responses.create(
            model=MODEL, previous_response_id=called.id, max_output_tokens=12, temperature=0,
            input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                    "output": json.dumps({"forecast": "sunny"})}])
        assert answer.status in ("completed", "incomplete") and answer.output_text
