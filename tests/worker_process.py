"""A `qworker serve --model sim` subprocess for end-to-end tests: started, waited for (its liveness
key), stopped with SIGTERM; and an `rq worker --burst` run with the JSON serializer."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.service_harness import KEYS, ROOT, checkout_env, spawn_worker, wait_for

RQ_SERIALIZER = "rq.serializers.JSONSerializer"


@contextmanager
def sim_worker(url: str, name: str = "sim-1", *args: str, model: str = "sim:step_ms=2",
               log_path: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`qworker serve` on the simulated engine, live when the block starts."""
    proc = spawn_worker(url, name, "--model", model, *args, log_path=log_path)
    client = redis.Redis.from_url(url)
    try:
        wait_for(lambda: proc.poll() is not None or client.exists(KEYS.worker(name)),
                 timeout=60, what=f"worker {name} to start")
        assert proc.poll() is None, f"worker {name} exited with {proc.returncode}"
        yield proc
    finally:
        client.close()
        stop_gracefully(proc)


def stop_gracefully(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def rq_burst(url: str, *queues: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """An RQ SimpleWorker (no fork) with the JSON serializer: runs what is queued, then exits.
    Without REDIS_URL / QWORKER_REDIS_URL, so `qworker_client.rq` uses the RQ worker's
    connection."""
    cmd = [sys.executable, "-m", "rq.cli", "worker", "--burst", "--url", url,
           "--serializer", RQ_SERIALIZER, "--worker-class", "rq.SimpleWorker", *queues]
    env = {k: v for k, v in checkout_env().items()
           if k not in ("REDIS_URL", "QWORKER_REDIS_URL")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
