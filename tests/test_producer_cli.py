"""`submit`, `tail` and `stats` run as real processes (`python -m qworker_client ...`, the same
command modules `qworker` dispatches to) against the test redis-server, with a fake worker
thread."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

import qworker.cli
from qworker_client.cli import CLIENT_COMMANDS
from qworker_client.protocol import ErrorEvent, Keys, WorkerInfo
from tests.conftest import free_port
from tests.producer_fakes import FakeWorker, completion, token_events, wait_for

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hel", "lo", " ", "wor", "ld", "", " ☃"]


def cli(*args: str, redis_url: str | None = None, env: dict[str, str] | None = None,
        timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    url_args = ["--redis-url", redis_url] if redis_url else []
    return subprocess.run(
        [sys.executable, "-m", "qworker_client", *args, *url_args], capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, env=env, input=stdin,
    )


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


@pytest.fixture
def live_worker(client: redis.Redis) -> str:
    """A liveness key standing for the fake workers (threads that write output streams): `submit`
    and `tail` say so at once, and wait only with --wait, when no worker is live."""
    info = WorkerInfo(name="fake", host="h", pid=1, model="sim", group="workers", started_ms=0)
    client.set(Keys().worker("fake"), info.model_dump_json(), ex=300)
    return "fake"


def worker_for(redis_url: str, client: redis.Redis, job_id: str, events: list) -> FakeWorker:
    """A fake worker that answers `job_id` once it has been submitted."""
    worker = FakeWorker(redis_url, job_id, events, pause_at=0, pause=lambda: wait_for(
        lambda: client.exists("qw:jobs") == 1, what="the job to be submitted"))
    worker.start()
    return worker


def test_the_qworker_cli_dispatches_to_the_client_and_worker_commands() -> None:
    for name in ("submit", "tail", "stats", "batch"):
        assert f"qworker_client.commands.{name}" in CLIENT_COMMANDS
    parser = qworker.cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subcommands.choices["serve"]
    assert "--redis-url" in serve.format_help(), "serve comes from the worker's entry point"


@pytest.mark.usefixtures("live_worker")
def test_submit_prints_the_final_text(redis_url: str, client: redis.Redis) -> None:
    worker = worker_for(redis_url, client, "cli-1", completion(TEXTS))
    proc = cli("submit", "Hello there", "--raw", "--id", "cli-1", "--max-tokens", "7",
               "--temperature", "0", "--stop", "\n\n", "--stop", "END", "--ignore-eos",
               redis_url=redis_url)
    worker.finish()
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "".join(TEXTS) + "\n", "")
    assert client.xrange("qw:jobs")[0][1] == {
        "id": "cli-1", "prompt": "Hello there", "max_tokens": "7", "temperature": "0.0",
        "stop": '["\\n\\n","END"]', "ignore_eos": "true",
    }


@pytest.mark.usefixtures("live_worker")
def test_submit_stream_prints_tokens_as_they_come(redis_url: str, client: redis.Redis) -> None:
    seen_first_tokens = threading.Event()
    worker = FakeWorker(redis_url, "live", completion(TEXTS), pause_at=3,
                        pause=lambda: seen_first_tokens.wait(30))
    worker.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qworker_client", "submit", "hi", "--id", "live", "--stream",
         "--redis-url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
        preexec_fn=default_sigint,
    )
    try:
        head = b""
        while len(head) < len("Hello "):  # the first 3 tokens, before the worker writes more
            chunk = os.read(proc.stdout.fileno(), 64)
            assert chunk, "submit --stream ended early"
            head += chunk
        assert head == b"Hello "
        seen_first_tokens.set()
        rest, err = proc.communicate(timeout=30)
    finally:
        seen_first_tokens.set()
        proc.kill()
    worker.finish()
    assert proc.returncode == 0, err
    assert (head + rest).decode() == "".join(TEXTS) + "\n"


@pytest.mark.usefixtures("live_worker")
def test_submit_json_result(redis_url: str, client: redis.Redis) -> None:
    worker = worker_for(redis_url, client, "j1", completion(TEXTS, "stop"))
    proc = cli("submit", "hi", "--id", "j1", "--json", redis_url=redis_url)
    worker.finish()
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "id": "j1", "text": "".join(TEXTS), "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": len(TEXTS)},
        "timings": {"queue_ms": 1, "ttft_ms": 2, "total_ms": 3},
    }


@pytest.mark.usefixtures("live_worker")
def test_submit_stream_json_prints_one_event_per_line(
    redis_url: str, client: redis.Redis
) -> None:
    worker = worker_for(redis_url, client, "j2", completion(TEXTS))
    proc = cli("submit", "hi", "--id", "j2", "--stream", "--json", redis_url=redis_url)
    worker.finish()
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines == [e.model_dump(exclude_none=True) for e in completion(TEXTS)]


@pytest.mark.usefixtures("live_worker")
def test_submit_reports_the_jobs_error(redis_url: str, client: redis.Redis) -> None:
    events = [*token_events(["a"]), ErrorEvent(code="prompt_too_long", message="4097 > 4096")]
    worker = worker_for(redis_url, client, "bad", events)
    proc = cli("submit", "hi", "--id", "bad", "--stream", redis_url=redis_url)
    worker.finish()
    assert proc.returncode == 1
    assert proc.stdout == "a"
    assert proc.stderr == "qworker: job bad failed: prompt_too_long: 4097 > 4096\n"


def test_submit_rejects_an_invalid_job_without_sending(
    redis_url: str, client: redis.Redis
) -> None:
    proc = cli("submit", "hi", "--max-tokens", "0", redis_url=redis_url)
    assert proc.returncode == 2
    assert proc.stderr.startswith("qworker: invalid job: max_tokens:")
    assert "Traceback" not in proc.stderr
    bad_json = cli("submit", "--prompt-token-ids", "[1,", redis_url=redis_url)
    assert bad_json.returncode == 2
    assert "--prompt-token-ids: invalid JSON" in bad_json.stderr
    assert client.exists("qw:jobs") == 0


def test_submit_chat_no_wait_and_stdin(redis_url: str, client: redis.Redis) -> None:
    chat = cli("submit", "hi ☃", "--system", "be brief", "--no-wait", "--prefix", "c",
               redis_url=redis_url)
    assert chat.returncode == 0, chat.stderr
    job_id = chat.stdout.strip()
    messages = json.dumps([{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "hi ☃"}], ensure_ascii=False,
                          separators=(",", ":"))
    assert client.xrange("c:jobs")[0][1] == {"id": job_id, "messages": messages}
    raw = cli("submit", "--messages-json", '[{"role": "user", "content": "x"}]', "--no-wait",
              "--json", "--prefix", "c", redis_url=redis_url)
    assert raw.returncode == 0, raw.stderr
    assert client.xrange("c:jobs")[1][1]["messages"] == '[{"role":"user","content":"x"}]'
    assert client.xrange("c:jobs")[1][1]["id"] == json.loads(raw.stdout)["id"]
    piped = cli("submit", "-", "--raw", "--no-wait", "--prefix", "c", redis_url=redis_url,
                stdin="from stdin\n")
    assert piped.returncode == 0, piped.stderr
    assert client.xrange("c:jobs")[2][1]["prompt"] == "from stdin\n"


@pytest.mark.usefixtures("live_worker")
def test_submit_times_out(redis_url: str) -> None:
    proc = cli("submit", "hi", "--timeout", "0.3", redis_url=redis_url)
    assert proc.returncode == 124
    assert "not finished within 0.3 s" in proc.stderr


def test_redis_url_from_the_environment(redis_url: str, client: redis.Redis) -> None:
    env = {**os.environ, "REDIS_URL": redis_url}
    proc = cli("submit", "hi", "--no-wait", env=env)
    assert proc.returncode == 0, proc.stderr
    assert client.xlen("qw:jobs") == 1


def test_unreachable_redis_is_one_line_not_a_traceback() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = cli("stats", redis_url=url)
    assert proc.returncode == 3
    assert proc.stderr.startswith(f"qworker: cannot reach Redis at {url} within 5 s: ")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_tail_prints_a_jobs_output(redis_url: str) -> None:
    FakeWorker(redis_url, "t1", completion(TEXTS), delay_s=0).run()
    text = cli("tail", "t1", redis_url=redis_url)
    assert (text.returncode, text.stdout) == (0, "".join(TEXTS) + "\n")
    as_json = cli("tail", "t1", "--json", redis_url=redis_url)
    assert [json.loads(line) for line in as_json.stdout.splitlines()] == [
        e.model_dump(exclude_none=True) for e in completion(TEXTS)]


def test_tail_follows_a_running_job_and_reports_errors(redis_url: str) -> None:
    events = [*token_events(["x", "y"]), ErrorEvent(code="internal", message="boom")]
    worker = FakeWorker(redis_url, "t2", events, delay_s=0.1)
    worker.start()
    proc = cli("tail", "t2", redis_url=redis_url)
    worker.finish()
    assert (proc.returncode, proc.stdout) == (1, "xy")
    assert "internal: boom" in proc.stderr
    bad = cli("tail", "not valid!", redis_url=redis_url)
    assert bad.returncode == 2 and "invalid job id" in bad.stderr


def test_stats(redis_url: str, client: redis.Redis) -> None:
    keys = Keys("qw")
    for i in range(5):
        client.xadd(keys.jobs, {"prompt": str(i)})
    client.xgroup_create(keys.jobs, "workers", id="0")
    taken = client.xreadgroup("workers", "w1", {keys.jobs: ">"}, count=2)
    client.xack(keys.jobs, "workers", taken[0][1][0][0])
    client.xadd(keys.dead, {"reason": "poison"})
    info = WorkerInfo(name="w1", host="h", pid=1, model="sim", group="workers", started_ms=0,
                      running=1, free_slots=7)
    client.set(keys.worker("w1"), info.model_dump_json(), ex=30)

    proc = cli("stats", "--json", redis_url=redis_url)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert {k: stats["jobs"][k] for k in ("length", "consumers", "pending", "lag")} == {
        "length": 5, "consumers": 1, "pending": 1, "lag": 3}
    assert stats["requeue"]["length"] == 0 and not stats["requeue"]["group_exists"]
    assert (stats["dead_letters"], stats["live_workers"], stats["backlog"]) == (1, 1, 3)
    assert stats["workers"] == [info.model_dump()]

    text = cli("stats", redis_url=redis_url)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["stream", "length", "lag", "pending", "consumers", "last",
                                "delivered"]
    assert lines[1].split()[:5] == ["qw:jobs", "5", "3", "1", "1"]
    assert lines[2].split()[:3] == ["qw:requeue", "0", "0"]
    assert "dead letters: 1" in lines
    assert "live workers: 1" in lines
    assert "  w1 host=h pid=1 model=sim running=1 free_slots=7" in lines


def default_sigint() -> None:
    """In the child: Ctrl-C as in a terminal, even where this suite runs with SIGINT ignored
    (a background job of a shell), which Python would otherwise inherit and keep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.usefixtures("live_worker")
def test_ctrl_c_cancels_the_submitted_job(redis_url: str, client: redis.Redis) -> None:
    release = threading.Event()
    worker = FakeWorker(redis_url, "int", completion(TEXTS), pause_at=1,
                        pause=lambda: release.wait(30))
    worker.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qworker_client", "submit", "hi", "--id", "int", "--stream",
         "--redis-url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
        preexec_fn=default_sigint,
    )
    try:
        assert os.read(proc.stdout.fileno(), 64) == TEXTS[0].encode()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        release.set()
        proc.kill()
    worker.finish()
    assert proc.returncode == 130
    assert err.decode() == "qworker: job int: cancelled\n"
    assert client.exists("qw:cancel:int") == 1
