"""`qworker gateway` as a process, configured through `QWORKER_*` variables as `serve` is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx2
import redis

from qworker_client.local_redis import free_port
from tests.service_harness import KEYS, ROOT, wait_for


def up(url: str) -> bool:
    try:
        return httpx2.get(f"{url}/health").status_code == 200
    except httpx2.HTTPError:
        return False


def test_the_command_takes_its_settings_from_the_environment(redis_url: str) -> None:
    port = free_port()
    env = {**os.environ, "QWORKER_PORT": str(port), "QWORKER_API_KEY": "a, b",
           "QWORKER_MAX_QUEUED": "0", "QWORKER_MAX_PROMPTS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "producer")])}
    proc = subprocess.Popen([sys.executable, "-m", "qworker_client", "gateway", "--redis-url",
                             redis_url, "--log-level", "warning"], env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or up(base), what="the gateway to start")
        assert proc.poll() is None
        redis.Redis.from_url(redis_url).set(KEYS.worker("w"), '{"model": "m"}', ex=60)
        body = {"model": "m", "prompt": "x"}
        assert httpx2.post(f"{base}/v1/completions", json=body).status_code == 401
        refused = httpx2.post(f"{base}/v1/completions", json=body,
                              headers={"Authorization": "Bearer b"})
        assert refused.status_code == 429  # no room at all: QWORKER_MAX_QUEUED=0
        two = httpx2.post(f"{base}/v1/completions", json={**body, "prompt": ["x", "y"]},
                          headers={"Authorization": "Bearer b"})
        assert two.status_code == 400  # QWORKER_MAX_PROMPTS=1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled


def test_the_gateway_says_its_base_url_when_ready_and_ignores_a_service_link(
        redis_url: str) -> None:
    """Variables that do not parse: one warning each, no crash; the ready line names the base
    URL; a declared model's request is queued while no worker is live, another model's is
    refused (503 no_live_worker)."""
    port = free_port()
    env = {**os.environ, "QWORKER_MAX_CONNECTIONS": "tcp://10.0.0.5:8000",
           "QWORKER_RESULT_TTL": "an hour", "QWORKER_MODEL": "m1, m2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "producer")])}
    proc = subprocess.Popen([sys.executable, "-m", "qworker_client", "gateway", "--redis-url",
                             redis_url, "--port", str(port), "--log-level", "warning"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == f"qworker gateway: ready, OpenAI base URL {base}/v1\n"
        assert up(base)
        body = {"model": "m2", "prompt": "x", "stream": True, "detach": True, "max_tokens": 2}
        with httpx2.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as queued:
            assert queued.status_code == 200  # its stream waits for a worker: left, detached
        other = httpx2.post(f"{base}/v1/completions", json={**body, "model": "m3"}, timeout=30)
        assert (other.status_code, other.json()["error"]["code"]) == (503, "no_live_worker")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(KEYS.jobs_of("m2")) == 1, "queued for the worker that is to start"
    warnings = [line for line in err.splitlines() if "qworker:" in line]
    assert warnings == [
        "qworker: warning: ignoring QWORKER_MAX_CONNECTIONS='tcp://10.0.0.5:8000': not an "
        "integer",
        "qworker: warning: ignoring QWORKER_RESULT_TTL='an hour': not an integer"], err
    assert "Traceback" not in err
