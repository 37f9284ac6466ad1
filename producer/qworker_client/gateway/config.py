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
    # None: no bound; else a request is refused (429) once this many jobs are unfinished
    max_queued: int | None = None
    retry_after_s: int = 1
    api_keys: tuple[str, ...] = ()  # empty: no auth
    result_ttl_s: int = DEFAULT_RESULT_TTL_S  # the workers' --result-ttl
    models_cache_s: float = 1.0  # how long the live workers' models are taken as known
    max_n: int = 16  # most choices one request may ask for
    files_dir: str | None = None  # the Files and Batch APIs' directory (None: no batches)
    # the output streams read at most once per interval, a choice's tokens of one read sent as
    # one chunk; 0: each token its own chunk, read as soon as it is there
    stream_interval_ms: float = 20.0
