"""OpenAI's logprobs through the gateway, as the `openai` SDK reads them: chat (`logprobs`,
`top_logprobs`) and completions (`logprobs: k`), streamed and not, equal to what the worker wrote
in the job's output stream (simulated engine, real redis-server)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import redis
from openai import OpenAI

from qworker_client.protocol import TokenEvent, parse_event
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, sim_engine

MODEL = "sim"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def client(redis_url: str) -> Iterator[tuple[OpenAI, redis.Redis]]:
    with live_worker(redis_url, "gw-lp", sim_engine()), gateway(redis_url) as url, \
            OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk, redis.Redis.from_url(redis_url)


def written(r: redis.Redis, job_id: str) -> list[TokenEvent]:
    events = [parse_event(f) for _, f in r.xrange(KEYS.out(job_id))]
    return [e for e in events if isinstance(e, TokenEvent)]


def test_chat_logprobs(client: tuple[OpenAI, redis.Redis]) -> None:
    sdk, r = client
    reply = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, logprobs=True,
                                        top_logprobs=3, seed=1)
    content = reply.choices[0].logprobs.content
    tokens = written(r, reply.id)
    assert [c.logprob for c in content] == [t.logprob for t in tokens]
    assert "".join(c.token for c in content) == reply.choices[0].message.content
    for c, t in zip(content, tokens, strict=True):
        assert c.bytes == list(c.token.encode()) and c.token == t.token
        assert [(x.token, x.logprob) for x in c.top_logprobs] == [
            (x.token, x.logprob) for x in t.top_logprobs or ()]
        assert len(c.top_logprobs) == 3
    plain = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None

    chunks = list(sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                              logprobs=True, top_logprobs=3, seed=1,
                                              stream=True))
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_completion_logprobs(client: tuple[OpenAI, redis.Redis]) -> None:
    sdk, r = client
    reply = sdk.completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=2, seed=3)
    lp = reply.choices[0].logprobs
    tokens = written(r, reply.id)
    assert lp.tokens == [t.token for t in tokens]
    assert lp.token_logprobs == [t.logprob for t in tokens]
    assert lp.top_logprobs == [{x.token: x.logprob for x in t.top_logprobs or ()} for t in tokens]
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]

    chunks = list(sdk.completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=2,
                                         seed=3, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_refused_logprobs_settings(client: tuple[OpenAI, redis.Redis]) -> None:
    sdk, _ = client
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    assert caught.value.response.json()["error"]["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model=MODEL, prompt="x", logprobs=21)
    assert caught.value.response.json()["error"]["param"] == "logprobs"
