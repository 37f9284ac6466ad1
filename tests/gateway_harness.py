"""The gateway in this process for tests: uvicorn in a thread on a free port, stopped on exit;
and requests to it that run in threads of their own."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx2
import redis
import uvicorn

from qworker_client.gateway.app import create_app
from qworker_client.gateway.config import GatewayConfig
from qworker_client.gateway.server import uvicorn_config
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
    server = uvicorn.Server(uvicorn_config(create_app(config), config, "warning"))
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


@dataclass
class OpenRequest:
    """A POST to the gateway in a thread of its own, recorded as it goes: its status, the job ids
    it names, each SSE event's data (streamed) or its JSON body, and when it ended."""

    url: str
    body: dict[str, Any]
    status: int | None = None
    job_ids: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    reply: Any = None
    ended_at: float | None = None
    failure: BaseException | None = None
    answered: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def done(self) -> bool:
        """A stream that ended with `[DONE]`."""
        return self.ended and self.events[-1:] == ["[DONE]"]

    def error_codes(self) -> list[str]:
        """The codes of the errors it got: an error event's, or the error body's."""
        errors = [json.loads(data) for data in self.events if data.startswith('{"error"')]
        if isinstance(self.reply, dict) and "error" in self.reply:
            errors.append(self.reply)
        return [e["error"]["code"] for e in errors]

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with httpx2.Client(timeout=120) as client, client.stream(
                    "POST", self.url, json=self.body) as response:
                self.status = response.status_code
                self.job_ids = response.headers.get("x-qworker-job-id", "").split(",")
                self.answered.set()
                if self.body.get("stream"):
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[6:])
                else:
                    self.reply = json.loads(response.read())
        except BaseException as exc:  # recorded: the test says what it expected
            self.failure = exc
        finally:
            self.ended_at = time.monotonic()
            self.answered.set()
