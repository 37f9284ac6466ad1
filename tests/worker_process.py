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
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from qworker_client.protocol import Keys
from qworker_client.redis_clients import sync_redis
from tests.service_harness import KEYS, ROOT, checkout_env, spawn_worker, wait_for

RQ_SERIALIZER = "rq.serializers.JSONSerializer"


@contextmanager
def sim_worker(url: str, name: str = "sim-1", *args: str, model: str = "sim:step_ms=2",
               log_path: Path | None = None, keys: Keys = KEYS
               ) -> Iterator[subprocess.Popen[bytes]]:
    """`qworker serve` on the simulated engine, live when the block starts (its liveness key
    among `keys`: on a Cluster, those of its model's slot)."""
    proc = spawn_worker(url, name, "--model", model, *args, log_path=log_path)
    client = sync_redis(url, socket_timeout=5)  # any URL a worker takes (Sentinel too)
    try:
        wait_for(lambda: proc.poll() is not None or client.exists(keys.worker(name)),
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


def rq_burst(url: str, *queues: str, jobs: list[str],
             timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """An RQ SimpleWorker (no fork) with the JSON serializer, until the RQ `jobs` have ended
    (finished or failed), then until it exits of itself: runs what is queued, then exits.
    Without REDIS_URL / QWORKER_REDIS_URL, so `qworker_client.rq` uses the RQ worker's
    connection. RQ's burst worker sometimes never exits after its last job (its pubsub thread's
    join, rq#1613: seen here in one full run of two): one that has not exited 10 s after every
    job ended is stopped, with its return code 0."""
    cmd = [sys.executable, "-m", "rq.cli", "worker", "--burst", "--url", url,
           "--serializer", RQ_SERIALIZER, "--worker-class", "rq.SimpleWorker", *queues]
    env = {k: v for k, v in checkout_env().items()
           if k not in ("REDIS_URL", "QWORKER_REDIS_URL")}
    connection = redis.Redis.from_url(url)
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            wait_for(lambda: proc.poll() is not None or all(
                RQJob.fetch(j, connection=connection, serializer=JSONSerializer).get_status()
                in ("finished", "failed") for j in jobs), timeout=timeout, what="the RQ jobs")
            try:
                out, err = proc.communicate(timeout=10)
                code = proc.returncode
            except subprocess.TimeoutExpired:  # rq#1613: every job ended, the worker hangs
                proc.terminate()
                out, err = proc.communicate(timeout=30)
                code = 0
        finally:
            if proc.poll() is None:
                proc.kill()
            connection.close()
    return subprocess.CompletedProcess(cmd, code, out, err)
