"""What no single-process server gives: a streamed request survives the crash of the worker
serving it (another worker resumes the job) and a Redis restart under the gateway, each chunk
reaching the client once."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import redis
from openai import OpenAI

from tests.conftest import RedisServer
from tests.gateway_harness import gateway, live_worker
from tests.service_harness import KEYS, check_stream, sim_engine, wait_for
from tests.worker_process import sim_worker

SIM = "sim:step_ms=20"
FAST_RECLAIM = ("--claim-idle-ms", "1000")


@pytest.fixture
def client(redis_url: str) -> Iterator[OpenAI]:
    with gateway(redis_url) as url, OpenAI(base_url=f"{url}/v1", api_key="unused",
                                           max_retries=0, timeout=120) as sdk:
        yield sdk


def streamed_text(stream: Iterator, on_chunk: object = None) -> tuple[str, str | None]:  # type: ignore[type-arg]
    text, reason = [], None
    for k, chunk in enumerate(stream):
        if callable(on_chunk):
            on_chunk(k)
        text.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


def test_a_stream_survives_the_crash_of_its_worker(client: OpenAI, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with sim_worker(redis_url, "fo-a", *FAST_RECLAIM, model=SIM) as a, \
            sim_worker(redis_url, "fo-b", *FAST_RECLAIM, model=SIM) as b:
        workers = {"fo-a": a, "fo-b": b}
        raw = client.completions.with_raw_response.create(
            model=SIM, prompt="survive", max_tokens=150, seed=6, stream=True)
        job_id = raw.headers["x-qworker-job-id"]
        killed: list[str] = []

        def kill_its_worker(k: int) -> None:
            if k == 20 and not killed:
                owner = (r.hget(KEYS.owner(job_id), "worker") or b"").decode().split("/")[0]
                killed.append(owner)
                workers[owner].send_signal(signal.SIGKILL)

        text, reason = streamed_text(raw.parse(), kill_its_worker)
    done = check_stream(r, job_id)  # indices 0..n-1 once each: resumed, not restarted
    assert killed and killed[0] in workers
    assert (text, reason) == (done.text, "length") and done.completion_tokens == 150


def test_a_stream_survives_a_redis_restart(client: OpenAI, redis_url: str,
                                           redis_server: RedisServer) -> None:
    with live_worker(redis_url, "fo-steady", sim_engine(SIM), claim_idle_ms=2000):
        stream = client.completions.create(model="sim", prompt="restart", max_tokens=120,
                                           seed=2, stream=True)
        restarted: list[bool] = []

        def restart(k: int) -> None:
            if k == 15 and not restarted:
                restarted.append(True)
                redis_server.restart()

        text, reason = streamed_text(stream, restart)
        r = redis.Redis.from_url(redis_url)
        done = wait_for(lambda: check_stream(r, stream.response.headers["x-qworker-job-id"]))
    assert restarted and (text, reason) == (done.text, "length")
