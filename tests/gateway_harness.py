"""The gateway in this process for tests: uvicorn in a thread on a free port, stopped on exit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import redis
import uvicorn

from qworker_client.gateway.app import create_app
from qworker_client.gateway.config import GatewayConfig
from qworker_client.local_redis import free_port
from tests.service_harness import KEYS, ThreadWorker, thread_worker, wait_for


@contextmanager
def live_worker(redis_url: str, name: str, *args: Any, **config: Any) -> Iterator[ThreadWorker]:
    """`thread_worker`, once its liveness key is there (what the gateway's models come from)."""
    with thread_worker(redis_url, name, *args, **config) as worker:
        client = redis.Redis.from_url(redis_url)
        wait_for(lambda: client.exists(KEYS.worker(name)), what=f"worker {name} to be live")
        client.close()
        yield worker


@contextmanager
def gateway(redis_url: str, **options: Any) -> Iterator[str]:
    """A running gateway over `redis_url`: yields its base URL (`http://127.0.0.1:<port>`)."""
    config = replace(GatewayConfig(redis_url=redis_url, port=free_port()), **options)
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=config.host,
                                           port=config.port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout=30,
                 what="the gateway to start")
        assert thread.is_alive(), "the gateway did not start"
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the gateway did not stop"
