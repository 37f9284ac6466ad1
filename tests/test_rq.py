"""RQ integration: `qworker_client.rq.generate` and a batch as RQ jobs, and the worker's on-done RQ
callback, each run by a real `rq worker` subprocess with the JSON serializer; and proof that
nothing RQ keeps in Redis is a pickle."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from qworker.service.on_done import OnDone, OnDoneTarget, callback_payload
from qworker_client import Producer
from qworker_client.protocol import DoneEvent
from qworker_client.rq import GENERATE, json_queue
from tests.conftest import RedisServer, free_port
from tests.service_harness import ROOT, wait_for
from tests.worker_process import rq_burst, sim_worker

CALLBACK = "tests.test_rq.record_done"


def record_done(result: dict[str, Any]) -> dict[str, Any]:
    """The on-done callback the tests' RQ worker runs: its return value shows what it got."""
    return {"seen": result}


def fetch(conn: redis.Redis, job_id: str) -> RQJob:
    return RQJob.fetch(job_id, connection=conn, serializer=JSONSerializer)


def rq_values(conn: redis.Redis) -> list[bytes]:
    """Every value RQ serialized into Redis: job data, meta and result, result streams."""
    values: list[bytes] = []
    for key in conn.scan_iter("rq:job:*"):
        if conn.type(key) != b"hash":
            continue
        job = conn.hgetall(key)
        values.append(zlib.decompress(job[b"data"]))
        values += [job[name] for name in (b"meta", b"result") if job.get(name)]
    for key in conn.scan_iter("rq:results:*"):
        for _, fields in conn.xrange(key):
            if fields.get(b"return_value"):
                values.append(base64.b64decode(fields[b"return_value"]))
    return values


def assert_json_only(conn: redis.Redis) -> int:
    """Every serialized RQ value parses as JSON (a pickle does not: it starts with b'\\x80')."""
    values = rq_values(conn)
    assert values, "no RQ jobs in Redis"
    for value in values:
        json.loads(value.decode("utf-8"))
    return len(values)


@pytest.fixture(scope="module")
def rq_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("rq-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(rq_redis: RedisServer) -> Iterator[str]:
    """A server of this module's own, flushed before each test: the RQ workers here run for up to
    a minute, and on the session's server (seen twice in a full run, never alone) their jobs were
    not all answered in that time."""
    client = redis.Redis.from_url(rq_redis.url)
    client.flushall()
    yield rq_redis.url
    client.close()


@pytest.fixture
def conn(redis_url: str) -> redis.Redis:
    """A client as RQ needs it: bytes, no decode_responses."""
    return redis.Redis.from_url(redis_url)


def test_generate_runs_in_a_real_rq_worker(redis_url: str, conn: redis.Redis) -> None:
    queue = json_queue("llm", conn)
    ok = queue.enqueue(GENERATE, kwargs={"prompt": "Hello", "max_tokens": 12, "seed": 7})
    chat = queue.enqueue(GENERATE, kwargs={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "seed": 1})
    invalid = queue.enqueue(GENERATE, kwargs={"prompt": "x", "max_tokens": 0})
    with sim_worker(redis_url):
        burst = rq_burst(redis_url, "llm", jobs=[ok.id, chat.id, invalid.id])
        with Producer(redis_url) as producer:
            expected = producer.submit("Hello", max_tokens=12, seed=7).result(timeout=30).text
    assert burst.returncode == 0, burst.stderr
    assert fetch(conn, ok.id).get_status() == "finished"
    result = fetch(conn, ok.id).return_value()
    assert result["text"] == expected and result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": 5, "completion_tokens": 12}
    assert result["id"] and set(result["timings"]) == {"queue_ms", "ttft_ms", "total_ms"}
    assert fetch(conn, chat.id).return_value()["usage"]["completion_tokens"] == 5
    failed = fetch(conn, invalid.id)
    latest = failed.latest_result()
    assert failed.get_status() == "failed" and latest is not None
    assert "max_tokens" in (latest.exc_string or "")
    assert_json_only(conn)


def test_rq_job_data_is_json_and_a_pickle_would_be_caught(conn: redis.Redis) -> None:
    json_job = json_queue("llm", conn).enqueue(GENERATE, kwargs={"prompt": "Hi"})
    raw = zlib.decompress(conn.hget(f"rq:job:{json_job.id}", "data"))
    func, _instance, args, kwargs = json.loads(raw)
    assert (func, args, kwargs) == (GENERATE, [], {"prompt": "Hi"})
    assert_json_only(conn)
    Queue("pickled", connection=conn).enqueue(GENERATE, kwargs={"prompt": "Hi"})  # RQ's default
    with pytest.raises(ValueError):  # UnicodeDecodeError or JSONDecodeError
        assert_json_only(conn)


def test_batch_as_one_rq_job(redis_url: str, conn: redis.Redis, tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": f"row {i}", "max_tokens": 6})
             for i in range(30)]
    lines[7] = json.dumps({"custom_id": "r7", "prompt": "x", "top_p": 0})
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    output = tmp_path / "out.jsonl"
    submitted = subprocess.run(
        [sys.executable, "-m", "qworker.cli", "batch", "submit-rq", str(source), str(output),
         "--queue", "batches", "--max-in-flight", "8", "--redis-url", redis_url],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    rq_job_id = json.loads(submitted.stdout)["rq_job_id"]
    assert fetch(conn, rq_job_id).get_status() == "queued"
    with sim_worker(redis_url):
        burst = rq_burst(redis_url, "batches", jobs=[rq_job_id])
    assert burst.returncode == 0, burst.stderr
    job = fetch(conn, rq_job_id)
    assert job.get_status() == "finished"
    summary = job.return_value()
    assert (summary["succeeded"], summary["invalid"], summary["lines"]) == (29, 1, 30)
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(30) if i != 7)
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["custom_id"]) for e in errors] == [(8, "r7")]
    assert_json_only(conn)


def test_on_done_enqueues_the_configured_callback(redis_url: str, conn: redis.Redis) -> None:
    flags = ("--on-done-rq-queue", "done", "--on-done-rq-func", CALLBACK)
    with sim_worker(redis_url, "sim-cb", *flags), Producer(redis_url) as producer:
        jobs = producer.submit_many(
            [{"prompt": f"cb {i}", "max_tokens": 4 + i, "seed": i} for i in range(3)])
        results = {job.id: job.result(timeout=30) for job in jobs}
        queue = json_queue("done", conn)
        rq_ids = wait_for(lambda: queue.get_job_ids() if queue.count == 3 else None,
                          timeout=30, what="3 on-done RQ jobs")
    burst = rq_burst(redis_url, "done", jobs=rq_ids)
    assert burst.returncode == 0, burst.stderr
    seen = {}
    for rq_id in rq_ids:
        job = fetch(conn, rq_id)
        assert (job.get_status(), job.func_name, job.origin) == ("finished", CALLBACK, "done")
        payload = job.return_value()["seen"]
        seen[payload["id"]] = payload
    assert seen == {
        job_id: {"id": job_id, "text": r.text, "finish_reason": r.finish_reason,
                 "usage": {"prompt_tokens": r.usage.prompt_tokens,
                           "completion_tokens": r.usage.completion_tokens}}
        for job_id, r in results.items()}
    assert_json_only(conn)


def test_on_done_keeps_a_callback_while_redis_is_down_and_enqueues_it_once(
    conn: redis.Redis,
) -> None:
    hook = OnDone(OnDoneTarget("done", CALLBACK), prefix="qw")
    done = DoneEvent(finish_reason="stop", text="hi", prompt_tokens=2, completion_tokens=1)
    job = SimpleNamespace(job_id="j-1", t0_ms=1234, outbox=[done])
    down = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))  # as the worker's client
    hook.notify(down, job)  # type: ignore[arg-type]
    assert len(hook.pending) == 1
    hook.notify(conn, job)  # type: ignore[arg-type]  # reported twice (e.g. a zombie's publish)
    hook.notify(conn, job)  # type: ignore[arg-type]
    queue = json_queue("done", conn)
    assert not hook.pending and queue.count == 1
    rq_job = fetch(conn, queue.get_job_ids()[0])
    assert (rq_job.func_name, rq_job.args) == (CALLBACK, [callback_payload("j-1", done)])


def test_the_service_imports_rq_only_when_asked(redis_url: str) -> None:
    check = ("import sys, qworker.service.worker, qworker.commands.serve; "
             "assert 'rq' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", check], cwd=ROOT, timeout=60).returncode == 0
    env = {**os.environ, "QWORKER_ON_DONE_RQ_QUEUE": "done"}  # the function flag is missing
    half = subprocess.run(
        [sys.executable, "-m", "qworker.cli", "serve", "--redis-url", redis_url, "--model", "sim"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert half.returncode == 2 and "go together" in half.stdout + half.stderr
