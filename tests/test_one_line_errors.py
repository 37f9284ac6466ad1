"""Every user error is one line on stderr, the exit code its kind's (2: usage, 3: runtime), and
never a traceback, from a real `qworker` process: a Redis URL without a scheme (checked by
`serve` before the model loads), an unreachable Redis, an invalid job, every bad model input
(tests/test_bad_models.py's, through `generate` and `serve`), and a reader that closes the pipe
(`qworker tail --json ID | head`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from qworker_client.protocol import Keys, TokenEvent, event_to_fields
from tests.conftest import free_port
from tests.producer_fakes import done_event
from tests.service_harness import ROOT, checkout_env
from tests.test_bad_models import BAD, truncated_gguf

USAGE, RUNTIME = 2, 3
NO_SCHEME = "localhost:6379/0"


def qworker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qworker_client", *args], cwd=ROOT,
                          env=checkout_env(), capture_output=True, text=True, timeout=timeout)


def assert_one_line(done: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), done.stderr
    assert says in done.stderr, done.stderr


@pytest.mark.parametrize("command", [["submit", "hi"], ["tail", "j1"], ["status", "j1"],
                                     ["stats"], ["jobs"], ["cancel", "j1"],
                                     ["batch", "run", "in.jsonl", "out.jsonl"]])
def test_a_redis_url_without_a_scheme_is_a_usage_error(command: list[str]) -> None:
    done = qworker(*command, "--redis-url", NO_SCHEME)
    assert_one_line(done, USAGE, f"qworker: invalid Redis URL '{NO_SCHEME}': it must start with "
                                 "redis://, rediss://, unix://")


def test_a_password_in_a_bad_url_is_not_printed() -> None:
    done = qworker("stats", "--redis-url", "redis//user:s3cret@host:1/0")
    assert_one_line(done, USAGE, "invalid Redis URL 'redis//user:***@host:1/0'")
    assert "s3cret" not in done.stderr


def test_a_refused_connection_is_a_runtime_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    done = qworker("submit", "hi", "--redis-url", url)
    assert_one_line(done, RUNTIME, f"qworker: cannot reach Redis at {url} within 5 s: ")


def test_an_invalid_job_is_refused_before_redis_is_asked() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing there: the job is refused first
    done = qworker("submit", "hi", "--model", "no spaces allowed", "--redis-url", url)
    assert_one_line(done, USAGE, "qworker: invalid job: model:")


def test_serve_checks_the_redis_url_before_the_model() -> None:
    """The model given cannot load; the URL's error comes first, so nothing was loaded."""
    done = qworker("serve", "--redis-url", NO_SCHEME, "--model", str(ROOT / "no" / "such.gguf"))
    assert_one_line(done, USAGE, f"invalid Redis URL '{NO_SCHEME}'")
    assert '"event": "bad_settings"' in done.stderr


def test_serve_checks_an_unknown_model_name_before_it_loads(redis_url: str,
                                                            tmp_path: Path) -> None:
    done = qworker("serve", "--redis-url", redis_url, "--model", "llama-9000")
    assert_one_line(done, USAGE, "'llama-9000' is neither an existing path nor a known model name")
    assert '"event": "model_not_loaded"' in done.stderr  # and no "loading engine" before it


def test_every_bad_model_is_one_line_from_a_real_generate(tmp_path: Path) -> None:
    def run(name: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        folder = tmp_path / name
        folder.mkdir()
        make, _ = BAD[name]
        return name, qworker("generate", "hi", "--model", str(make(folder)), "--dtype", "float32")

    with ThreadPoolExecutor(2) as pool:  # each process imports torch: two at a time
        results = list(pool.map(run, sorted(BAD)))
    for name, done in results:
        assert done.stdout == "", name
        assert_one_line(done, USAGE, BAD[name][1])
        assert done.stderr.startswith("qworker generate: "), name


def test_a_bad_model_in_serve_is_one_error_line(redis_url: str, tmp_path: Path) -> None:
    done = qworker("serve", "--redis-url", redis_url, "--model", str(truncated_gguf(tmp_path)))
    assert done.returncode == USAGE and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if '"level": "error"' in line]
    assert len(errors) == 1 and "m.gguf: not a readable GGUF file" in errors[0]


def test_tail_into_a_closed_pipe_exits_quietly(redis_url: str) -> None:
    """`qworker tail --json ID | head -n 1`: more output than a pipe holds, its reader gone."""
    client = redis.Redis.from_url(redis_url)
    key = Keys().out("long")
    pipe = client.pipeline(transaction=False)
    for i in range(5000):
        pipe.xadd(key, event_to_fields(TokenEvent(i=i, token_id=7, text="word ")))
    pipe.xadd(key, event_to_fields(done_event(["word "] * 5000)))
    pipe.execute()
    client.close()
    shell = (f"set -o pipefail; {sys.executable} -m qworker_client tail --json long "
             f"--redis-url {redis_url} | head -n 1")
    done = subprocess.run(["bash", "-c", shell], cwd=ROOT, env=checkout_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith('{"type": "token", "i": 0')
    assert done.stdout.count("\n") == 1
    assert done.stderr == ""  # no BrokenPipeError, no "Exception ignored" at exit
    assert done.returncode == 141  # what a shell reports for a writer its reader left


def test_demo_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    unknown = qworker("demo", "--model", "llama-9000")
    assert_one_line(unknown, USAGE, "qworker demo: failed: 'llama-9000' is neither")
    bad_url = subprocess.run([sys.executable, "-m", "qworker_client", "demo", "--model", "sim"],
                             cwd=ROOT, env={**checkout_env(), "REDIS_URL": NO_SCHEME},
                             capture_output=True, text=True, timeout=60)
    assert bad_url.returncode == USAGE and "Traceback" not in bad_url.stderr
    assert bad_url.stderr.splitlines()[-1].startswith(
        f"qworker demo: failed: invalid Redis URL '{NO_SCHEME}'")


def default_sigint() -> None:
    """In the child: Ctrl-C as in a terminal, even where the suite runs with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted(args: list[str], on_stderr: str | None) -> subprocess.CompletedProcess[str]:
    """`qworker *args`, sent SIGINT once a stderr line holds `on_stderr` (None: once the first
    character of its answer is on stdout)."""
    proc = subprocess.Popen([sys.executable, "-m", "qworker_client", *args], cwd=ROOT,
                            env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint)
    assert proc.stdout is not None and proc.stderr is not None
    seen_out = seen_err = ""
    try:
        if on_stderr is None:
            seen_out = proc.stdout.read(1)
            assert seen_out, "no answer"
        else:
            while on_stderr not in seen_err:
                line = proc.stderr.readline()
                assert line, f"ended before {on_stderr!r}: {seen_err}"
                seen_err += line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, seen_out + out, seen_err + err)


def test_ctrl_c_while_serve_loads_the_model_is_no_traceback(redis_url: str) -> None:
    done = interrupted(["serve", "--redis-url", redis_url, "--model", "smollm2"],
                       '"event": "loading engine"')
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert '"event": "interrupted while loading the model"' in done.stderr


def test_ctrl_c_while_generate_writes_is_no_traceback() -> None:
    done = interrupted(["generate", "hi", "--model", "sim:step_ms=50", "--max-tokens", "500"],
                       None)
    assert done.returncode == 130 and done.stderr == "", done.stderr
    assert done.stdout.endswith("\n")
