"""The gateway on the real default model (SmolLM2, float64 so greedy texts compare exactly): its
greedy output is the worker's own through the protocol, its usage the token counts; and a worker
with its default configuration completes a prompt as long as its context allows."""

from __future__ import annotations

import random
from pathlib import Path

import redis
import torch
from openai import OpenAI

from qworker.cli import build_parser
from qworker.commands.serve import build_engine
from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.model.decoder import load_model
from qworker.model.tokenizer.tokenizer import Tokenizer
from qworker_client import Producer
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import check_stream

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The capital of France is"


def test_greedy_output_and_usage_equal_the_worker_s_own(
    redis_url: str, smollm2_path: Path, smollm2_tokenizer: Tokenizer
) -> None:
    model = load_model(smollm2_path, dtype=torch.float64)
    engine = Engine(model, smollm2_tokenizer, EngineConfig(max_num_seqs=4, num_blocks=256))
    client = redis.Redis.from_url(redis_url)
    with live_worker(redis_url, "gw-real", engine, model="smollm2"), \
            gateway(redis_url) as url, Producer(redis_url) as producer, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
        assert [m.id for m in sdk.models.list()] == ["smollm2"]
        direct = producer.submit(messages=MESSAGES, max_tokens=24, temperature=0).result(300)
        chat = sdk.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24,
                                           temperature=0)
        streamed = sdk.chat.completions.create(model="smollm2", messages=MESSAGES,
                                               max_tokens=24, temperature=0, stream=True)
        deltas = "".join(c.choices[0].delta.content or "" for c in streamed)
        text = sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8,
                                      temperature=0)
        direct_text = producer.submit(PROMPT, max_tokens=8, temperature=0).result(300)
    assert chat.choices[0].message.content == deltas == direct.text != ""
    assert chat.choices[0].finish_reason == direct.finish_reason
    done = check_stream(client, chat.id)  # one token event per completion token
    assert chat.usage is not None and text.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (
        len(smollm2_tokenizer.encode_chat(MESSAGES)), done.completion_tokens)
    assert text.choices[0].text == direct_text.text
    assert text.usage.prompt_tokens == len(smollm2_tokenizer.encode(PROMPT))
    assert text.usage.completion_tokens == check_stream(client, text.id).completion_tokens


def test_a_default_worker_completes_a_prompt_of_max_model_len_minus_one(redis_url: str) -> None:
    serve = ["serve", "--redis-url", redis_url, "--model", "smollm2"]
    engine = build_engine(build_parser().parse_args(serve))  # the worker's own: weights released
    n = engine.max_model_len - 1
    ids = [random.Random(3).randrange(100, 40_000) for _ in range(n)]
    with live_worker(redis_url, "gw-long", engine, model="smollm2"), gateway(redis_url) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as sdk:
        got = sdk.completions.create(model="smollm2", prompt=ids, max_tokens=2, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert got.usage is not None and got.usage.prompt_tokens == n
    # the context holds one more token: the completion is it
    assert (got.usage.completion_tokens, got.choices[0].finish_reason) == (1, "length")
