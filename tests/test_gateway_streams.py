"""Streams that survive disconnects: a client that goes cancels its job (unless it detached), a
detached stream resumes after `Last-Event-ID` with each chunk once, and a job's status is asked
through the gateway, the Python client and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx2
import openai
import pytest
import redis
from openai import OpenAI

from qworker_client import Producer
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, ROOT, check_stream, sim_engine, terminal
from tests.service_harness import wait_for as wait

MODEL = "sim"
SLOW = "sim:step_ms=20"  # 50 tokens a second: a stream is still running when the client goes


@pytest.fixture
def base_url(redis_url: str) -> Iterator[str]:
    with live_worker(redis_url, "gw-slow", sim_engine(SLOW)), gateway(redis_url) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def sse_events(lines: Iterator[str], limit: int | None = None) -> list[tuple[str | None, str]]:
    """(id, data) of each event, up to `limit` events (all: until the stream ends)."""
    events: list[tuple[str | None, str]] = []
    event_id, data = None, None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data is not None:
            events.append((event_id, data))
            event_id, data = None, None
            if limit is not None and len(events) == limit:
                break
    return events


def test_a_client_that_goes_cancels_its_streamed_job(client: OpenAI, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="go", max_tokens=2000,
                                                      stream=True)
    job_id = raw.headers["x-qworker-job-id"]
    stream = raw.parse()
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    done = wait(lambda: terminal(r, job_id), timeout=30, what="the job to end")
    assert done.type == "done" and done.finish_reason == "cancelled"
    assert done.completion_tokens < 2000


def test_a_client_that_goes_cancels_its_waiting_job(client: OpenAI, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL, prompt="wait", max_tokens=2000, timeout=0.5)
    job_id = wait(lambda: [k.decode().removeprefix(KEYS.out("")) for k in r.keys(KEYS.out("*"))],
                  what="the job's output")[0]
    done = wait(lambda: terminal(r, job_id), timeout=30, what="the job to end")
    assert done.type == "done" and done.finish_reason == "cancelled"


def test_a_detached_stream_resumes_after_last_event_id_each_chunk_once(
    base_url: str, redis_url: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "resume"}],
            "max_tokens": 60, "seed": 8, "stream": True, "detach": True,
            "stream_options": {"include_usage": True}}
    with httpx2.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        job_id = response.headers["x-qworker-job-id"]
        first = sse_events(response.iter_lines(), limit=5)
    r = redis.Redis.from_url(redis_url)
    last_id = first[-1][0]
    assert last_id is not None
    resume = httpx2.get(f"{base_url}/v1/jobs/{job_id}/stream",
                        headers={"Last-Event-ID": last_id}, timeout=60)
    rest = sse_events(resume.iter_lines())
    done = check_stream(r, job_id)
    assert done.finish_reason == "length"  # it ran on while no client was there
    assert rest[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in first + rest[:-1]]
    ids = [event_id for event_id, _ in first + rest[:-1]]
    assert ids[-1] == ids[-2]  # the usage chunk goes with the last entry, the done event's
    ids = ids[:-1]
    assert len(set(ids)) == len(ids) and ids == sorted(ids, key=lambda i: tuple(
        int(p) for p in i.split("-")))  # each once, in stream order
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == done.text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 60 and chunks[-1]["id"] == job_id
    again = httpx2.get(f"{base_url}/v1/jobs/{job_id}/stream",
                       headers={"Last-Event-ID": rest[-2][0] or ""})
    assert sse_events(again.iter_lines()) == [(None, "[DONE]")]  # nothing after the end


def test_a_resumed_stream_of_an_unknown_job_is_a_404(base_url: str) -> None:
    reply = httpx2.get(f"{base_url}/v1/jobs/nobody/stream")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "job_not_found"


def test_status_through_the_gateway_the_client_and_the_cli(redis_url: str) -> None:
    with gateway(redis_url) as url, Producer(redis_url) as producer:
        job = producer.submit("status", max_tokens=30, seed=1)

        def status() -> dict[str, object]:
            return httpx2.get(f"{url}/v1/jobs/{job.id}").json()

        assert status() == {"id": job.id, "status": "queued"} and producer.status(
            job.id).status == "queued"
        assert httpx2.get(f"{url}/v1/jobs/nobody").json() == {"id": "nobody",
                                                              "status": "unknown"}
        with live_worker(redis_url, "gw-status", sim_engine(SLOW)):
            wait(lambda: status()["status"] == "running", what="the job to run")
            wait(lambda: status()["status"] == "done", what="the job to end")
        result = status()["result"]
        assert isinstance(result, dict)
        assert result["text"] == job.result().text and result["finish_reason"] == "length"
        assert result["usage"] == {"prompt_tokens": 6, "completion_tokens": 30}
        cli = subprocess.run([sys.executable, "-m", "qworker_client", "status", job.id, "--json",
                              "--redis-url", redis_url], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
        assert json.loads(cli.stdout) == status()
        bad = producer.submit("x", max_tokens=5, min_tokens=1, stop_token_ids=[10 ** 9])
        with live_worker(redis_url, "gw-status-2"):
            wait(lambda: producer.status(bad.id).status == "error", what="the error")
        assert producer.status(bad.id).to_dict()["error"]["code"] == "invalid_request"


def test_several_readers_of_one_job_each_get_all_of_it(base_url: str, redis_url: str) -> None:
    body = {"model": MODEL, "prompt": "share", "max_tokens": 40, "seed": 4, "stream": True}
    texts: list[str] = []

    def resume(job_id: str) -> None:
        with httpx2.stream("GET", f"{base_url}/v1/jobs/{job_id}/stream", timeout=60) as reply:
            events = sse_events(reply.iter_lines())
        texts.append("".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1]))

    with httpx2.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        job_id = response.headers["x-qworker-job-id"]
        readers = [threading.Thread(target=resume, args=(job_id,)) for _ in range(2)]
        lines = response.iter_lines()
        first = sse_events(lines, limit=3)  # the readers join a stream under way
        for reader in readers:
            reader.start()
        rest = sse_events(lines)
    for reader in readers:
        reader.join(60)
    own = "".join(json.loads(d)["choices"][0]["text"] for _, d in (first + rest)[:-1])
    done = check_stream(redis.Redis.from_url(redis_url), job_id)
    assert texts == [done.text, done.text] and own == done.text
