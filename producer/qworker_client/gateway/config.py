"""The gateway's settings: where the queue is, where to listen, what to allow."""

from __future__ import annotations

from dataclasses import dataclass

from qworker_client.connect import DEFAULT_REDIS_URL, DEFAULT_RESULT_TTL_S
from qworker_client.protocol import DEFAULT_PREFIX


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX
    host: str = "127.0.0.1"
    port: int = 8000
    # a request is refused (429) that would make more jobs than this unfinished for its model
    # (None: no bound)
    max_queued: int | None = 1024
    retry_after_s: int = 1
    api_keys: tuple[str, ...] = ()  # empty: no auth
    keys_file: str | None = None  # API keys of tenants (gateway/tenants.py), besides api_keys
    # keys that open the dashboard (`/dashboard`) as admin: retry, cancel, purge; the API keys
    # open it read-only (docs/dashboard.md)
    admin_keys: tuple[str, ...] = ()
    result_ttl_s: int = DEFAULT_RESULT_TTL_S  # the workers' --result-ttl
    models_cache_s: float = 1.0  # how long the live workers' models are taken as known
    max_n: int = 16  # most choices one request may ask for
    max_prompts: int = 256  # most prompts one completions request may hold (400 past it)
    max_jobs: int = 256  # most jobs one request may queue: its prompts times `n` (400 past it)
    max_body_bytes: int = 8 * 1024 * 1024  # a request body, file uploads aside (413 past it)
    max_header_bytes: int = 32 * 1024  # a request's line and headers (431 past it)
    header_timeout_s: float = 10.0  # a request's line and headers must have come by then
    keep_alive_s: int = 5  # an idle kept-alive connection is closed after that
    # clients connected at once: past it the one idle longest is closed (None: the open-file
    # limit less what the gateway keeps for Redis and files, `server.default_max_connections`)
    max_connections: int | None = None
    files_dir: str | None = None  # the Files and Batch APIs' directory (None: no batches)
    # the output streams read at most once per interval, a choice's tokens of one read sent as
    # one chunk; 0: each token its own chunk, read as soon as it is there
    stream_interval_ms: float = 20.0
    # models served even while none of their workers is live (a fleet scaled to zero): their
    # requests are queued for the worker that starts; the live workers' models are served anyway
    models: tuple[str, ...] = ()


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def base_url(host: str, port: int) -> str:
    """What an OpenAI client is given: `http://HOST:PORT/v1` (a wildcard host as 127.0.0.1)."""
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
