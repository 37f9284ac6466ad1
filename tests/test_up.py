"""`qworker up`: starts its own Redis (or the embedded one), a worker, and stops only those."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from qworker_client import Producer
from qworker_client.local_redis import RedisProcess, free_port
from tests.service_harness import ROOT, checkout_env, wait_for

URL_LINE = re.compile(r"qworker up: Redis at (redis://\S+) \((.*)\)$")


@dataclass
class Up:
    proc: subprocess.Popen[str]
    url: str
    description: str
    stderr: queue.Queue[str]
    stdout: queue.Queue[str]

    @property
    def redis_pid(self) -> int:
        found = re.search(r"pid (\d+)", self.description)
        assert found, self.description
        return int(found.group(1))

    def stderr_text(self) -> str:
        return drain(self.stderr)

    def stdout_text(self) -> str:
        return drain(self.stdout)


def drain(lines: queue.Queue[str]) -> str:
    out = []
    while not lines.empty():
        out.append(lines.get())
    return "".join(out)


def _pump(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


def start_up(*args: str, timeout: float = 60) -> Up:
    cmd = [sys.executable, "-m", "qworker.cli", "up", "--model", "sim:step_ms=2", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**checkout_env(), "PYTHONFAULTHANDLER": "1"})
    out: queue.Queue[str] = queue.Queue()
    err: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, out), daemon=True).start()
    threading.Thread(target=_pump, args=(proc.stderr, err), daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = out.get(timeout=0.2)
        except queue.Empty:
            assert proc.poll() is None, f"qworker up exited: {''.join(err.queue)}"
            continue
        if m := URL_LINE.match(line.rstrip("\n")):
            return Up(proc, m.group(1), m.group(2), err, out)
    proc.kill()
    raise AssertionError("qworker up printed no URL")


def finish(up: Up, sig: int = signal.SIGTERM) -> int:
    up.proc.send_signal(sig)
    try:
        return up.proc.wait(30)
    except subprocess.TimeoutExpired:
        up.proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        time.sleep(2)
        up.proc.kill()
        raise AssertionError(f"qworker up did not stop: {up.stderr_text()[-6000:]}") from None


@contextmanager
def running_up(*args: str) -> Iterator[Up]:
    up = start_up(*args)
    try:
        yield up
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # a zombie whose new parent has not reaped it yet


def run_one_job(url: str) -> None:
    with Producer(url) as producer:
        result = producer.submit("hello up", max_tokens=8, temperature=0).result(timeout=60)
    assert (result.finish_reason, result.usage.completion_tokens) == ("length", 8)


def test_up_starts_redis_with_aof_and_stops_it_on_sigterm(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    with running_up("--data-dir", str(data), "--name", "up-test-1") as up:
        assert up.description.startswith("redis-server")
        run_one_job(up.url)
        assert list((data / "appendonlydir").glob("*.aof*")), "AOF files in the data dir"
        config = redis.Redis.from_url(up.url, decode_responses=True).config_get("maxmemory*")
        assert (config["maxmemory"], config["maxmemory-policy"]) == (str(1024**3), "noeviction")
        second = subprocess.run(
            [sys.executable, "-m", "qworker.cli", "up", "--model", "sim", "--data-dir",
             str(data)], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert second.returncode == 2 and "another qworker up uses" in second.stderr
        assert finish(up) == 0
        wait_for(lambda: process_gone(up.redis_pid), 10, what="redis-server to stop")


def test_up_redis_dies_with_a_killed_up(tmp_path: Path) -> None:
    with running_up("--data-dir", str(tmp_path / "redis"), "--name", "up-test-2",
                    "--redis-maxmemory", "64mb") as up:
        client = redis.Redis.from_url(up.url, decode_responses=True)
        assert client.config_get("maxmemory")["maxmemory"] == str(64 * 1024**2)
        client.close()
        finish(up, signal.SIGKILL)
        wait_for(lambda: process_gone(up.redis_pid), 10, what="redis-server to follow its parent")


def test_up_embedded_server_warns_and_runs_jobs() -> None:
    with running_up("--embedded", "--name", "up-test-3") as up:
        assert "NOTHING IS DURABLE" in up.description
        run_one_job(up.url)
        assert finish(up) == 0
        assert "EMBEDDED in-process Redis" in up.stderr_text()


def test_up_with_a_given_redis_leaves_it_running(redis_url: str) -> None:
    with running_up("--redis-url", redis_url, "--name", "up-test-4") as up:
        assert (up.url, up.description) == (redis_url, "given")
        run_one_job(up.url)
        assert finish(up) == 0
    assert redis.Redis.from_url(redis_url).ping()


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of our own that asks for a password: its URL, password included."""
    server = RedisProcess(tmp_path, ("--save", ""), password="pw-" + os.urandom(8).hex())
    try:
        yield server.start()
    finally:
        server.stop()


def test_up_never_prints_the_password_it_was_given(password_redis: str) -> None:
    password = password_redis.split(":")[2].split("@")[0]
    with running_up("--redis-url", password_redis, "--name", "up-test-6") as up:
        assert up.url == password_redis.replace(password, "***")
        run_one_job(password_redis)
        assert finish(up) == 0
        printed = up.stdout_text() + up.stderr_text()
    assert "***@" in printed and password not in printed


def test_demo_streams_jobs_side_by_side_and_leaves_nothing_running() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "qworker.cli", "demo", "--model", "sim:step_ms=10",
         "--max-tokens", "12", "--stagger", "0.02"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "REDIS_URL"})
    assert result.returncode == 0, result.stderr
    tagged = [line.split("]")[0] for line in result.stdout.splitlines() if line.startswith("[")]
    assert {"[haiku", "[paris", "[lists", "[robot"} <= set(tagged)
    first_robot = tagged.index("[robot")
    last_haiku = len(tagged) - 1 - tagged[::-1].index("[haiku")
    assert first_robot < last_haiku, "the jobs' tokens interleave"
    assert "4 jobs, 48 tokens" in result.stdout
    assert "stopping the worker and the Redis it started" in result.stderr
    pids = [int(p) for p in re.findall(r"\(pid (\d+)", result.stderr)]
    assert len(pids) == 2, result.stderr  # its redis-server and its worker
    for pid in pids:
        assert process_gone(pid), pid


TRIPWIRE = """
import os, signal, sys
from qworker.cli import main

class Tripwire:
    '''stderr that sends SIGTERM to its own process while writing the first "done" log line:
    the handler then runs inside the logger's write, under its lock.'''

    def __init__(self, stream):
        self.stream, self.armed = stream, True

    def write(self, text):
        if self.armed and '"done"' in text:
            self.armed = False
            os.kill(os.getpid(), signal.SIGTERM)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stderr = Tripwire(sys.stderr)
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_a_log_line_is_written_still_drains(redis_url: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", TRIPWIRE, "up", "--redis-url", redis_url, "--model",
         "sim:step_ms=2", "--name", "up-test-5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**checkout_env(), "PYTHONFAULTHANDLER": "1"})
    try:
        client = redis.Redis.from_url(redis_url)
        wait_for(lambda: client.exists("qw:worker:up-test-5"), 30, what="the worker")
        run_one_job(redis_url)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"the worker deadlocked:\n{err[-4000:]}")


OPENAI_LINE = re.compile(r"qworker up: OpenAI base URL (http://\S+) \(gateway pid (\d+);")
GATEWAY_READY = re.compile(r"qworker gateway: ready, OpenAI base URL (http://\S+)$")


def wait_for_line(lines: queue.Queue[str], pattern: re.Pattern[str], proc: subprocess.Popen[str],
                  timeout: float = 60) -> re.Match[str]:
    """The first line of `lines` that `pattern` matches (the lines before it are dropped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            assert proc.poll() is None, "qworker up exited"
            continue
        if m := pattern.match(line.rstrip("\n")):
            return m
    raise AssertionError(f"no line like {pattern.pattern}")


def children_of(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.add(int(stat.parent.name))
    return found


def test_up_gateway_answers_the_openai_sdk_and_ctrl_c_stops_all_three(
        tmp_path: Path, smollm2_path: Path) -> None:
    """One command to an OpenAI endpoint, on the default model: Redis, worker and gateway; the
    first request may come while the worker still loads (it is queued for it)."""
    from openai import OpenAI

    port = free_port()
    with running_up("--model", "smollm2", "--gateway", "--port", str(port), "--data-dir",
                    str(tmp_path / "redis"), "--name", "up-gateway-1") as up:
        ready = wait_for_line(up.stdout, GATEWAY_READY, up.proc)
        announced = wait_for_line(up.stdout, OPENAI_LINE, up.proc)
        base_url = f"http://127.0.0.1:{port}/v1"
        assert ready.group(1) == announced.group(1) == base_url
        assert "curl " + base_url + "/chat/completions" in wait_for_line(
            up.stdout, re.compile(r"qworker up:   e\.g\. (curl .*)"), up.proc).group(1)
        client = OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert reply.usage is not None and reply.usage.completion_tokens == 8
        # the model's own words (not a fixed text: bf16 logits tie here, "The" or "L'Étoile")
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content
        streamed = client.chat.completions.create(
            model="smollm2", max_tokens=4, stream=True,
            messages=[{"role": "user", "content": "Hi"}])
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
        children = children_of(up.proc.pid)
        assert {up.redis_pid, int(announced.group(2))} <= children, children
        assert finish(up, signal.SIGINT) == 0  # Ctrl-C
    for pid in children:
        assert process_gone(pid), f"pid {pid} outlived qworker up"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_up_gateway_dies_with_a_killed_up(redis_url: str) -> None:
    port = free_port()
    with running_up("--redis-url", redis_url, "--gateway", "--port", str(port), "--name",
                    "up-gateway-2") as up:
        gateway_pid = int(wait_for_line(up.stdout, OPENAI_LINE, up.proc).group(2))
        finish(up, signal.SIGKILL)
        wait_for(lambda: process_gone(gateway_pid), 15, what="the gateway to follow up")


def test_up_gateway_on_a_taken_port_is_one_line(redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ran = subprocess.run(
            [sys.executable, "-m", "qworker.cli", "up", "--redis-url", redis_url, "--model",
             "sim", "--gateway", "--port", str(port)],
            capture_output=True, text=True, cwd=ROOT, timeout=90, env=checkout_env())
    assert ran.returncode == 2, ran.stderr
    assert re.search(rf"^qworker up: the gateway exited \(\d+\) before it listened on "
                     rf"127\.0\.0\.1:{port} \(its error is above\); is the port taken\?",
                     ran.stderr, re.M), ran.stderr
    assert "Traceback" not in ran.stderr


def test_up_gateway_without_the_extra_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qworker.commands import up_gateway

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # find_spec: as if not installed
    with pytest.raises(up_gateway.GatewayError, match=re.escape(up_gateway.GATEWAY_EXTRA)):
        up_gateway.GatewayChild("redis://127.0.0.1:1/0", "qw", "m").start()
    import tomllib

    extras = tomllib.loads((ROOT / "producer" / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = {re.split(r"[\[<>=]", d)[0] for d in extras["gateway"]}
    assert set(up_gateway.EXTRA_MODULES) <= named, "the modules looked for are the extra's"
