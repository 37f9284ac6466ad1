"""The producer and its commands against a real worker: `qworker serve --model sim` (torch-free)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from qworker_client import DoneEvent, JobError, Producer, TokenEvent
from tests.producer_fakes import wait_for

ROOT = Path(__file__).resolve().parents[1]


def qworker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qworker.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def worker(redis_url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qworker.cli", "serve", "--redis-url", redis_url,
         "--model", "sim:step_ms=2", "--name", "sim-1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
    )
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: proc.poll() is not None or client.exists("qw:worker:sim-1") == 1,
                 timeout=60, what="the worker to start")
        assert proc.poll() is None, proc.stderr.read().decode()
        yield proc
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_jobs_stream_and_finish(redis_url: str, worker: subprocess.Popen[bytes]) -> None:
    with Producer(redis_url) as prod:
        jobs = prod.submit_many(
            [{"prompt": f"job {i}", "max_tokens": 5 + i, "seed": i} for i in range(12)])
        for n, job in enumerate(jobs):
            events = list(job.stream(timeout=60))
            tokens, done = events[:-1], events[-1]
            assert all(isinstance(e, TokenEvent) for e in tokens)
            assert isinstance(done, DoneEvent)
            assert [e.i for e in tokens] == list(range(5 + n))
            assert "".join(e.text for e in tokens) == done.text
            assert (done.finish_reason, done.completion_tokens) == ("length", 5 + n)
            assert done.prompt_tokens == len(f"job {n}".encode())  # sim: one token per byte


def test_cancel_stops_a_running_job(redis_url: str, worker: subprocess.Popen[bytes]) -> None:
    with Producer(redis_url) as prod:
        job = prod.submit("long", max_tokens=20_000, ignore_eos=True)
        for event in job.stream(timeout=60):
            if isinstance(event, TokenEvent) and event.i == 3:
                job.cancel()
                break
        result = job.result(timeout=60)
    assert result.finish_reason == "cancelled"
    assert 4 <= result.usage.completion_tokens < 20_000


def test_a_job_the_worker_rejects_raises_job_error(
    redis_url: str, worker: subprocess.Popen[bytes]
) -> None:
    with Producer(redis_url) as prod:
        prod.redis.xadd("qw:jobs", {"id": "raw-1", "prompt": "x", "max_tokens": "many"})
        with pytest.raises(JobError) as info:
            prod.job("raw-1").result(timeout=60)
    assert info.value.code == "invalid_request"
    assert "max_tokens" in info.value.message


def test_cli_against_the_worker(redis_url: str, worker: subprocess.Popen[bytes]) -> None:
    with Producer(redis_url) as prod:
        expected = prod.submit("Hello", max_tokens=12, seed=7).result(timeout=60).text
    streamed = qworker("submit", "Hello", "--raw", "--max-tokens", "12", "--seed", "7",
                       "--stream", "--id", "cli-e2e", "--redis-url", redis_url)
    assert (streamed.returncode, streamed.stdout) == (0, expected + "\n"), streamed.stderr
    tailed = qworker("tail", "cli-e2e", "--json", "--redis-url", redis_url)
    events = [json.loads(line) for line in tailed.stdout.splitlines()]
    assert [e["type"] for e in events] == ["token"] * 12 + ["done"]
    assert events[-1]["text"] == expected
    stats = qworker("stats", "--json", "--redis-url", redis_url)
    assert stats.returncode == 0, stats.stderr
    data = json.loads(stats.stdout)
    assert data["live_workers"] == 1 and data["workers"][0]["name"] == "sim-1"
    assert data["jobs"]["group_exists"]
    assert (data["jobs"]["lag"], data["jobs"]["pending"]) == (0, 0)
