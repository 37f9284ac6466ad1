"""The examples in other languages (examples/), run against a live `qworker serve --model sim`.

They follow docs/protocol.md only; each is checked against what the worker wrote to Redis. The Go
one is skipped only where no Go toolchain is on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from qworker_client.protocol import DoneEvent
from qworker_client.scripts import SUBMIT_SCRIPT
from tests.service_harness import ROOT, spawn_worker, stop_process, terminal, wait_for

EXAMPLES = ROOT / "examples"
SHELL = EXAMPLES / "redis-cli"
NODE = EXAMPLES / "node"
GO = EXAMPLES / "go"


@pytest.fixture
def worker(redis_url: str, tmp_path: Path) -> Iterator[str]:
    proc = spawn_worker(redis_url, "examples-1", "--model", "sim:step_ms=2",
                        log_path=tmp_path / "worker.log")
    client = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: proc.poll() is not None or client.exists("qw:worker:examples-1"), 60,
                 what="the worker to start")
        assert proc.poll() is None, (tmp_path / "worker.log").read_text()
        yield redis_url
    finally:
        client.close()
        stop_process(proc)


def run(cmd: list[str], url: str, cwd: Path = ROOT, timeout: float = 60
        ) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "REDIS_URL": url, "QW_TIMEOUT": "30"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, timeout=timeout)


def done_of(url: str, job_id: str) -> DoneEvent:
    event = terminal(redis.Redis.from_url(url), job_id)
    assert isinstance(event, DoneEvent), event
    return event


def check_streamed(url: str, job_id: str, result: subprocess.CompletedProcess[bytes],
                   max_tokens: int) -> None:
    """The example printed exactly the job's text and its usage line, and exited 0."""
    assert result.returncode == 0, result.stderr.decode()
    done = done_of(url, job_id)
    assert result.stdout.decode() == done.text + "\n"
    assert (done.finish_reason, done.completion_tokens) == ("length", max_tokens)
    assert f"finish_reason=length prompt_tokens={done.prompt_tokens} completion_tokens=" \
           f"{max_tokens}" in result.stderr.decode()


# ---------------------------------------------------------------------- redis-cli


def test_redis_cli_example_submits_and_streams(worker: str) -> None:
    submitted = run(["bash", str(SHELL / "producer.sh"), 'say "hi" \\ there', "max_tokens",
                     "40", "temperature", "0"], worker)
    assert submitted.returncode == 0, submitted.stderr.decode()
    job_id = submitted.stdout.decode().strip()
    check_streamed(worker, job_id, run(["bash", str(SHELL / "consumer.sh"), job_id], worker), 40)


def test_redis_cli_example_reports_an_error_event(worker: str) -> None:
    submitted = run(["bash", str(SHELL / "producer.sh"), "hi", "colour", "blue"], worker)
    job_id = submitted.stdout.decode().strip()
    result = run(["bash", str(SHELL / "consumer.sh"), job_id], worker)
    assert result.returncode == 1
    assert "error invalid_request: unknown field 'colour'" in result.stderr.decode()


def test_redis_cli_consumer_prints_any_text_exactly(redis_url: str) -> None:
    """Newlines, quotes, backslashes, commas, escapes' look-alikes, values that look like entry
    ids and multi-byte characters all come out as written."""
    client = redis.Redis.from_url(redis_url)
    texts = ['a "b"\\ c\nd,e', "12-3", "", "\\x41 \\\" \\n", "é€😀", "\t\r\n"]
    for i, text in enumerate(texts):
        client.xadd("qw:out:synthetic", {"type": "token", "i": i, "token_id": 7, "text": text})
    client.xadd("qw:out:synthetic", {
        "type": "done", "finish_reason": "stop", "text": "".join(texts), "prompt_tokens": 1,
        "completion_tokens": len(texts), "queue_ms": 0, "ttft_ms": 0, "total_ms": 0})
    result = run(["bash", str(SHELL / "consumer.sh"), "synthetic"], redis_url)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == "".join(texts) + "\n"


def rolled_back(redis_url: str) -> str:
    """A stream as after Redis lost its last writes and the job ran again from what was left:
    indices 0 1 2 1 2 3, a done, then index 3 and a second done. Readers print 0-3 once."""
    client = redis.Redis.from_url(redis_url)
    for i in (0, 1, 2, 1, 2, 3):
        client.xadd("qw:out:rolled", {"type": "token", "i": i, "token_id": 7, "text": f"<{i}>"})
    for text in ("<0><1><2><3>", "other"):
        client.xadd("qw:out:rolled", {
            "type": "done", "finish_reason": "stop", "text": text, "prompt_tokens": 1,
            "completion_tokens": 4, "queue_ms": 0, "ttft_ms": 0, "total_ms": 0})
        client.xadd("qw:out:rolled", {"type": "token", "i": 3, "token_id": 7, "text": "<3>"})
    return "rolled"


def check_rolled_back(result: subprocess.CompletedProcess[bytes]) -> None:
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == "<0><1><2><3>\n"
    assert result.stderr.decode().count("finish_reason=") == 1


def test_redis_cli_consumer_skips_indices_it_has_seen(redis_url: str) -> None:
    job_id = rolled_back(redis_url)
    check_rolled_back(run(["bash", str(SHELL / "consumer.sh"), job_id], redis_url))


def test_redis_cli_cancel_ends_a_running_job(worker: str) -> None:
    submitted = run(["bash", str(SHELL / "producer.sh"), "long", "max_tokens", "20000",
                     "ignore_eos", "true"], worker)
    job_id = submitted.stdout.decode().strip()
    client = redis.Redis.from_url(worker)
    wait_for(lambda: client.xlen(f"qw:out:{job_id}") >= 3, 30, what="tokens")
    assert run(["bash", str(SHELL / "cancel.sh"), job_id], worker).returncode == 0
    result = run(["bash", str(SHELL / "consumer.sh"), job_id], worker)
    assert result.returncode == 0 and "finish_reason=cancelled" in result.stderr.decode()


def test_redis_cli_tenants_from_the_protocol_doc(worker: str) -> None:
    """The redis-cli lines of protocol.md's "Tenants and fair share", as they are written there:
    weights set, a job of each tenant queued and run, each ended as its tenant's."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    block = text.split("### Tenants and fair share", 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines() if line.startswith("redis-cli ")]
    assert len(lines) == 4 and any(" tenant acme " in line for line in lines)
    for line in lines:
        result = run(["bash", "-c", line.replace("redis-cli ", 'redis-cli -u "$REDIS_URL" ', 1)],
                     worker)
        assert result.returncode == 0, result.stderr.decode()
    client = redis.Redis.from_url(worker, decode_responses=True)
    wait_for(lambda: client.xlen("qw:recent") == 2, 30, what="both jobs to end")
    ended = {f["id"]: (f["tenant"], f["status"]) for _, f in client.xrange("qw:recent")}
    assert ended == {"acme-1": ("acme", "done"), "globex-1": ("globex", "done")}
    assert client.hget("qw:tenants", "acme") == "3 0 0"
    client.close()


# ---------------------------------------------------------------------- Node.js


@pytest.fixture(scope="module")
def node_modules() -> Path:
    npm = shutil.which("npm")
    assert npm and shutil.which("node"), "node and npm must be on PATH for the Node example"
    subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=NODE,
                   check=True, timeout=300, capture_output=True)
    return NODE / "node_modules"


def test_node_example_submits_and_streams_jobs_side_by_side(
        worker: str, node_modules: Path) -> None:
    ids = []
    for n in (20, 30):
        submitted = run(["node", "producer.mjs", f"node job {n}", f"max_tokens={n}"], worker,
                        cwd=NODE)
        assert submitted.returncode == 0, submitted.stderr.decode()
        ids.append(submitted.stdout.decode().strip())
    env = {**os.environ, "REDIS_URL": worker, "QW_TIMEOUT": "30"}
    consumers = [subprocess.Popen(["node", "consumer.mjs", job_id], cwd=NODE, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for job_id in ids]
    for job_id, n, proc in zip(ids, (20, 30), consumers, strict=True):
        out, err = proc.communicate(timeout=60)
        check_streamed(worker, job_id, subprocess.CompletedProcess([], proc.returncode, out, err),
                       n)


def test_node_example_reports_an_error_event(worker: str, node_modules: Path) -> None:
    submitted = run(["node", "producer.mjs", "hi", "top_p=7"], worker, cwd=NODE)
    job_id = submitted.stdout.decode().strip()
    result = run(["node", "consumer.mjs", job_id], worker, cwd=NODE)
    assert result.returncode == 1
    assert "error invalid_request:" in result.stderr.decode()
    assert "top_p" in result.stderr.decode()


def test_node_producer_queues_an_id_once(redis_url: str, node_modules: Path) -> None:
    assert SUBMIT_SCRIPT in (NODE / "producer.mjs").read_text(), "the script of protocol.md"
    for attempt in range(2):
        submitted = run(["node", "producer.mjs", "twice", "id=node-once", "max_tokens=3"],
                        redis_url, cwd=NODE)
        assert submitted.returncode == 0, submitted.stderr.decode()
        assert submitted.stdout.decode().strip() == "node-once"
        assert ("already submitted" in submitted.stderr.decode()) == (attempt == 1)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    entries = client.xrange("qw:jobs")
    assert [fields for _, fields in entries] == [
        {"prompt": "twice", "max_tokens": "3", "id": "node-once"}]
    assert client.get("qw:sub:node-once") == entries[0][0]


def test_node_consumer_skips_indices_it_has_seen(redis_url: str, node_modules: Path) -> None:
    job_id = rolled_back(redis_url)
    check_rolled_back(run(["node", "consumer.mjs", job_id], redis_url, cwd=NODE))


# ---------------------------------------------------------------------- Go


@pytest.mark.skipif(shutil.which("go") is None,
                    reason="no Go toolchain (`go` not on PATH): the Go example is not run")
def test_go_example_submits_and_streams(worker: str) -> None:
    tidy = subprocess.run(["go", "mod", "tidy"], cwd=GO, capture_output=True, timeout=300)
    assert tidy.returncode == 0, tidy.stderr.decode()
    submitted = run(["go", "run", ".", "produce", "go job", "max_tokens=25"], worker, cwd=GO,
                    timeout=300)
    assert submitted.returncode == 0, submitted.stderr.decode()
    job_id = submitted.stdout.decode().strip()
    check_streamed(worker, job_id, run(["go", "run", ".", "consume", job_id], worker, cwd=GO,
                                       timeout=300), 25)
    check_rolled_back(run(["go", "run", ".", "consume", rolled_back(worker)], worker, cwd=GO,
                          timeout=300))
