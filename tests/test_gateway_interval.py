"""The gateway's stream interval (`--stream-interval`): with one, a choice's tokens of one read go
out as one chunk (the texts joined, the last token's entry id, OpenAI's chunk shape); with 0,
each token is its own chunk. Either way the chunks join to the job's text, each entry once."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2
import pytest
import redis

from qworker_client.gateway.streams.frames import coalesced
from qworker_client.gateway.streams.reader import Batch
from qworker_client.gateway.streams.tokens import Text
from qworker_client.protocol import DoneEvent
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, check_stream, sim_engine
from tests.test_gateway_streams import sse_events

FAST = "sim:step_ms=2"  # 500 tokens a second: a 100 ms read brings dozens


def test_a_run_of_tokens_is_one_token_and_the_rest_is_kept() -> None:
    done = DoneEvent(finish_reason="length", text="abc", prompt_tokens=1, completion_tokens=3)
    batch: Batch = [("j", "1-0", Text(0, "a")), ("j", "1-1", Text(1, "")),
                    ("j", "1-2", Text(2, "bc")), ("j", "1-3", done)]
    assert coalesced(batch) == [("j", "1-2", Text(0, "abc")), ("j", "1-3", done)]
    assert coalesced(batch[1:2]) == batch[1:2] and coalesced([]) == []


@pytest.fixture
def worker(redis_url: str) -> Iterator[None]:
    with live_worker(redis_url, "gw-interval", sim_engine(FAST)):
        yield


def stream(url: str, kind: str, max_tokens: int) -> tuple[str, list[tuple[str | None, str]]]:
    """(job id, SSE events) of one streamed request."""
    path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}) \
        if kind == "chat" else ("/v1/completions", {"prompt": "go"})
    body.update(model="sim", max_tokens=max_tokens, seed=3, stream=True)
    with httpx2.stream("POST", url + path, json=body, timeout=60) as response:
        return response.headers["x-qworker-job-id"], sse_events(response.iter_lines())


def texts(kind: str, events: list[tuple[str | None, str]]) -> list[str]:
    """The text of each chunk that has some (not the finish chunk), in order."""
    chunks = [json.loads(data)["choices"][0] for _, data in events[:-1]]
    found = [c["delta"].get("content") if kind == "chat" else c["text"] for c in chunks]
    return [t for t in found if t]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_with_an_interval_a_chunk_holds_the_tokens_of_one_read(
    redis_url: str, worker: None, kind: str
) -> None:
    with gateway(redis_url, stream_interval_ms=100) as url:
        job_id, events = stream(url, kind, 200)
    done = check_stream(redis.Redis.from_url(redis_url), job_id)
    assert events[-1] == (None, "[DONE]")
    assert "".join(texts(kind, events)) == done.text
    assert len(texts(kind, events)) < done.completion_tokens / 3  # several tokens a chunk
    ids = [tuple(int(p) for p in str(i).split("-")) for i, _ in events[:-1]]
    assert ids == sorted(set(ids))  # each entry once, in stream order
    if kind == "chat":
        assert json.loads(events[0][1])["choices"][0]["delta"]["role"] == "assistant"


def test_with_no_interval_each_token_is_its_own_chunk(redis_url: str, worker: None) -> None:
    with gateway(redis_url, stream_interval_ms=0) as url:
        job_id, events = stream(url, "completion", 60)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    check_stream(r, job_id)
    entries = r.xrange(KEYS.out(job_id))
    want = [(entry_id, fields["text"]) for entry_id, fields in entries
            if fields["type"] == "token" and fields["text"]]
    got = [(i, json.loads(data)["choices"][0]["text"]) for i, data in events[:-2]]
    assert got == want
