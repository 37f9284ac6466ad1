"""The gateway in this process for tests: uvicorn in a thread on a free port, stopped on exit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import uvicorn

from qworker_client.gateway.app import create_app
from qworker_client.gateway.config import GatewayConfig
from qworker_client.local_redis import free_port
from tests.service_harness import wait_for


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
