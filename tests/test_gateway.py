"""The gateway through the official `openai` SDK (sync), against a real redis-server and a
simulated worker: chat and text completions, streaming and not, n, seeds, stops, models, usage."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2
import pytest
import redis
from openai import OpenAI

from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, check_stream, expected

MODEL = "sim"  # what a simulated worker's liveness key names


@pytest.fixture
def base_url(redis_url: str) -> Iterator[str]:
    with live_worker(redis_url, "gw-w1"), gateway(redis_url) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def sim_text(job_id: str, **fields: object) -> tuple[str, str | None]:
    wire = {k: json.dumps(v) if isinstance(v, list) else v for k, v in fields.items()}
    return expected({job_id: wire})[job_id]


def test_a_completion_is_the_worker_s_own_output(client: OpenAI, redis_url: str) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=12, seed=5)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    text, reason = sim_text(r.id, prompt="Hello there", max_tokens=12, seed=5)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].index) == (
        text, reason, 0)
    done = check_stream(redis.Redis.from_url(redis_url), r.id)  # the job ran under this id
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(b"Hello there"), 12)
    assert r.usage.total_tokens == 11 + 12 == done.prompt_tokens + done.completion_tokens


def test_streamed_completion_deltas_join_to_the_whole_text(client: OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, seed=9)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=20, seed=9,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.object == "text_completion" for c in chunks)


def test_chat_streamed_and_not(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there"}]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           seed=2)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant" and len(message.content or "") == 16
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            seed=2, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    usage, whole_usage = chunks[-1].usage, whole.usage
    assert chunks[-1].choices == [] and usage is not None and whole_usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole_usage.prompt_tokens, 16)


def test_n_choices_are_n_jobs_seeded_seed_plus_k(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="seeds", max_tokens=10, n=3, seed=40)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for k, choice in enumerate(r.choices):
        one = client.completions.create(model=MODEL, prompt="seeds", max_tokens=10, seed=40 + k)
        assert choice.text == one.choices[0].text
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 30)  # the prompt once


def test_n_choices_stream_interleaved_with_their_indices(client: OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                   "content": "x"}],
                                           max_tokens=8, n=2, seed=1)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8, n=2, seed=1,
        stream=True))
    for k in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices[0].index == k)
        assert text == whole.choices[k].message.content


def test_a_list_of_prompts_and_token_id_prompts(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=4, seed=3)
    assert [c.text for c in r.choices] == [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, seed=3).choices[0].text
        for p in ("ab", "cd")]
    by_ids = client.completions.create(model=MODEL, prompt=[97, 98], max_tokens=4, seed=3)
    assert by_ids.choices[0].text == r.choices[0].text  # the byte tokenizer: "ab" is [97, 98]


def test_stop_strings_end_the_text_before_them(client: OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="stop", max_tokens=30, seed=11)
    stop = free.choices[0].text[10]
    r = client.completions.create(model=MODEL, prompt="stop", max_tokens=30, seed=11, stop=stop)
    cut = free.choices[0].text.index(stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (free.choices[0].text[:cut],
                                                               "stop")


def test_vllm_extra_parameters_reach_the_job(client: OpenAI, redis_url: str) -> None:
    r = client.completions.create(model=MODEL, prompt="extra", max_tokens=6, seed=4,
                                  extra_body={"top_k": 3, "min_tokens": 6, "ignore_eos": True})
    assert r.choices[0].text == sim_text(r.id, prompt="extra", max_tokens=6, seed=4, top_k=3,
                                         min_tokens=6, ignore_eos="true")[0]


def test_models_and_health(client: OpenAI, base_url: str) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "qworker"
    health = httpx2.get(f"{base_url}/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})


def test_each_response_names_its_jobs(client: OpenAI, redis_url: str) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="id", max_tokens=2,
                                                      n=2)
    ids = raw.headers["x-qworker-job-id"].split(",")
    assert ids == [f"{raw.parse().id}.0", f"{raw.parse().id}.1"]
    assert all(redis.Redis.from_url(redis_url).exists(KEYS.out(i)) for i in ids)
