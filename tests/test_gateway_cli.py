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
