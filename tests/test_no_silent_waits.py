"""No command sits silent: a Redis that does not answer is one line within the 5 s connect
timeout; `submit` and `tail` say at once when no live worker would run the job (the gateway's
liveness rule, `stats.why_not_served`) and wait only with `--wait`; `status` and `tail` of an
unknown job exit 1. `submit` sends a chat by default, a plain prompt where the live workers'
model has no chat template. Real processes against the suite's redis-server and a real
`qworker serve --model sim`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from qworker.engine.byte_tokenizer import ByteTokenizer
from qworker_client.protocol import Keys, WorkerInfo
from tests.service_harness import ROOT, checkout_env
from tests.test_one_line_errors import RUNTIME, assert_one_line, qworker
from tests.worker_process import sim_worker

KEYS = Keys()


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung or firewalled Redis)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


def fake_worker(client: redis.Redis, name: str, model: str, chat: bool | None) -> None:
    """A liveness key as a worker of `model` writes it (`chat`: its model has a template)."""
    info = WorkerInfo(name=name, host="h", pid=1, model=model, group="workers", started_ms=0,
                      chat=chat)
    client.set(KEYS.worker(name), info.model_dump_json(exclude_none=True), ex=60)


def queued(client: redis.Redis, stream: str = KEYS.jobs) -> list[dict[str, str]]:
    return [fields for _, fields in client.xrange(stream)]


def test_a_redis_that_never_answers_is_one_line_within_the_connect_timeout(
        silent_redis: str) -> None:
    commands = [["submit", "hi"], ["tail", "j1"], ["status", "j1"], ["stats"]]
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "qworker_client", *c, "--redis-url",
                               silent_redis], cwd=ROOT, env=checkout_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for c in commands]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert_one_line(done, RUNTIME, f"cannot reach Redis at {silent_redis} within 5 s: ")
    assert time.monotonic() - started < 15  # 5 s each, side by side, and the startups


def test_submit_with_no_live_worker_says_so_and_queues_nothing(
        redis_url: str, client: redis.Redis) -> None:
    done = qworker("submit", "hi", "--redis-url", redis_url)
    assert_one_line(done, RUNTIME, "qworker: no worker is live: nothing queued")
    assert "--wait" in done.stderr
    assert not list(client.scan_iter(match=f"{KEYS.jobs}*"))


def test_submit_of_a_model_no_live_worker_serves_names_those_served(
        redis_url: str, client: redis.Redis) -> None:
    fake_worker(client, "w1", "smollm2", chat=True)
    done = qworker("submit", "hi", "--model", "qwen3", "--redis-url", redis_url)
    assert_one_line(done, RUNTIME, "no live worker serves model 'qwen3' (live workers serve: "
                                   "smollm2): nothing queued")
    assert not client.exists(KEYS.jobs_of("qwen3"))


def test_no_wait_queues_and_warns(redis_url: str, client: redis.Redis) -> None:
    done = qworker("submit", "hi", "--id", "later", "--no-wait", "--redis-url", redis_url)
    assert done.returncode == 0 and done.stdout == "later\n"
    assert done.stderr == "qworker: no worker is live: job later is queued\n"
    assert [f["id"] for f in queued(client)] == ["later"]


def test_wait_says_so_at_once_then_runs_on_the_first_worker(
        redis_url: str, client: redis.Redis) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qworker_client", "submit", "hi", "--id", "w", "--wait",
         "--max-tokens", "5", "--json", "--redis-url", redis_url], cwd=ROOT, env=checkout_env(),
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # before any worker exists
        assert first == "qworker: no worker is live: job w is queued; waiting for a worker\n"
        with sim_worker(redis_url, "late-1"):
            out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and err == "", err
    assert json.loads(out)["usage"]["completion_tokens"] == 5


def test_submit_to_a_live_worker_runs_a_chat_by_default(
        redis_url: str, client: redis.Redis) -> None:
    with sim_worker(redis_url, "chatty"):
        (name,) = client.scan_iter(match=KEYS.worker_pattern)
        assert json.loads(client.get(name) or "{}")["chat"] is True  # the byte tokenizer's
        done = qworker("submit", "hi", "--max-tokens", "4", "--json", "--redis-url", redis_url)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        chat = ByteTokenizer().encode_chat([{"role": "user", "content": "hi"}])
        assert json.loads(done.stdout)["usage"]["prompt_tokens"] == len(chat) > 2
        raw = qworker("submit", "hi", "--raw", "--max-tokens", "4", "--json", "--redis-url",
                      redis_url)
        assert json.loads(raw.stdout)["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize(("chat", "flags", "sent"), [
    (True, [], "messages"), (None, [], "messages"), (False, [], "prompt"),
    (True, ["--raw"], "prompt"), (False, ["--chat"], "messages"),
    (False, ["--system", "be brief"], "messages"),
])
def test_a_plain_prompt_goes_as_the_live_workers_model_takes_it(
        redis_url: str, client: redis.Redis, chat: bool | None, flags: list[str],
        sent: str) -> None:
    fake_worker(client, "w1", "m1", chat=chat)
    done = qworker("submit", "hi", "--model", "m1", "--no-wait", *flags, "--redis-url", redis_url)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (fields,) = queued(client, KEYS.jobs_of("m1"))
    assert sent in fields and ({"prompt", "messages"} - {sent}).isdisjoint(fields)
    if sent == "messages":
        assert json.loads(fields["messages"])[-1] == {"role": "user", "content": "hi"}


def test_status_and_tail_of_an_unknown_job_exit_1(redis_url: str) -> None:
    status = qworker("status", "nope", "--redis-url", redis_url)
    assert (status.returncode, status.stdout, status.stderr) == (1, "unknown\n", "")
    as_json = qworker("status", "nope", "--json", "--redis-url", redis_url)
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout) == {"id": "nope", "status": "unknown"}
    tail = qworker("tail", "nope", "--redis-url", redis_url, timeout=30)
    assert_one_line(tail, 1, "qworker: job nope is unknown: ")
    waiting = qworker("tail", "nope", "--wait", "--timeout", "0.3", "--redis-url", redis_url)
    assert waiting.returncode == 124  # followed all the same, as a plain XADD's job may be


def test_tail_of_a_queued_job_with_no_live_worker(redis_url: str, client: redis.Redis) -> None:
    assert qworker("submit", "hi", "--id", "q1", "--no-wait", "--redis-url",
                   redis_url).returncode == 0
    tail = qworker("tail", "q1", "--redis-url", redis_url)
    assert_one_line(tail, RUNTIME, "qworker: job q1 is queued and no worker is live")
    waiting = qworker("tail", "q1", "--wait", "--timeout", "0.5", "--redis-url", redis_url)
    assert waiting.returncode == 124
    assert waiting.stderr.splitlines() == [
        "qworker: job q1 is queued and no worker is live; waiting for one",
        "qworker: job q1: not finished within 0.5 s"]
