"""Health of one worker and the HTTP endpoint that serves it with the Prometheus metrics.

- `/healthz`: 200 while the loop completed an iteration within `stall_s` and the last Redis round
  trip succeeded; 503 otherwise (also before the first round trip). A readiness / compose check.
- `/livez`: 200 while the loop is not stuck, whatever Redis does (restarting a worker does not
  bring Redis back). A liveness check.
- `/metrics`: the registry in Prometheus' text format.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

DEFAULT_STALL_S = 60.0


@dataclass
class Health:
    """Updated by the worker loop (one thread), read by the HTTP server's threads."""

    stall_s: float = DEFAULT_STALL_S
    last_tick: float = field(default_factory=time.monotonic)
    redis_ok: bool | None = None  # None: no round trip yet
    redis_error: str = ""

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def redis_succeeded(self) -> None:
        self.redis_ok, self.redis_error = True, ""

    def redis_failed(self, error: str) -> None:
        self.redis_ok, self.redis_error = False, error[:200]

    def loop_age_s(self) -> float:
        return time.monotonic() - self.last_tick

    def live(self) -> bool:
        return self.loop_age_s() <= self.stall_s

    def healthy(self) -> bool:
        return self.live() and self.redis_ok is True

    def report(self) -> dict[str, Any]:
        redis_state = {None: "unknown", True: "ok", False: "failed"}[self.redis_ok]
        return {"ok": self.healthy(), "live": self.live(),
                "loop_age_s": round(self.loop_age_s(), 3), "stall_s": self.stall_s,
                "redis": redis_state, "redis_error": self.redis_error}


def _handler(registry: CollectorRegistry, health: Health) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/livez"):
                ok = health.healthy() if path == "/healthz" else health.live()
                body = json.dumps(health.report()).encode()
                self._send(200 if ok else 503, body, "application/json")
            else:
                self._send(404, b"not found: try /metrics, /healthz or /livez\n", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes every few seconds would drown the worker's own logs

    return Handler


def serve(port: int, registry: CollectorRegistry, health: Health,
          host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serves /metrics, /healthz and /livez on `host`:`port` from a daemon thread (loopback
    unless told otherwise: a container or pod passes 0.0.0.0)."""
    server = ThreadingHTTPServer((host, port), _handler(registry, health))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name=f"metrics:{port}", daemon=True)
    thread.start()
    return server
