"""Settings of the Redis service around the engine: the `qworker serve` flags but the engine's."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from qworker_client.protocol import DEFAULT_GROUP, DEFAULT_PREFIX


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class ServiceConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX
    group: str = DEFAULT_GROUP
    name: str = field(default_factory=default_worker_name)
    model: str = ""  # shown in the worker's liveness key
    claim_idle_ms: int = 30_000  # entries idle longer than this are reclaimed by any worker
    max_deliveries: int = 5  # delivered more often than this: dead-lettered as poison
    drain_timeout: float = 30.0  # seconds of stepping after SIGTERM before requeueing the rest
    result_ttl: int = 3_600  # seconds an output stream lives after its last event
    metrics_port: int = 0  # 0: no Prometheus endpoint
    block_ms: int = 1_000  # XREADGROUP BLOCK while idle
    backoff_min_s: float = 0.05
    backoff_max_s: float = 2.0
    dead_maxlen: int = 10_000  # `<prefix>:dead` is trimmed to about this many entries
    # No finished loop turn for this long: the loop is stuck, so the heartbeat stops and peers
    # reclaim the jobs. Must exceed the longest legitimate engine step.
    stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.claim_idle_ms < 100:
            raise ValueError("claim_idle_ms must be >= 100")
        if self.max_deliveries < 1:
            raise ValueError("max_deliveries must be >= 1")
        if self.drain_timeout < 0 or self.result_ttl < 1 or self.block_ms < 1:
            raise ValueError("drain_timeout must be >= 0, result_ttl and block_ms >= 1")
        if self.dead_maxlen < 1 or self.stall_timeout_s <= 0:
            raise ValueError("dead_maxlen must be >= 1 and stall_timeout_s > 0")

    @property
    def heartbeat_s(self) -> float:
        """How often in-flight entries are re-claimed (by a thread, whatever the loop does):
        well within `claim_idle_ms`, so three beats in a row may fail before a peer reclaims."""
        return min(self.claim_idle_ms / 4000, 10.0)

    @property
    def reclaim_s(self) -> float:
        return max(self.claim_idle_ms / 2000, 0.1)

    @property
    def consumer_idle_ms(self) -> int:
        """A consumer that owns nothing, idle this long and without a live worker key, is removed
        from the group."""
        return 10 * self.claim_idle_ms

    @property
    def liveness_ttl_ms(self) -> int:
        return int(max(3 * self.heartbeat_s * 1000, 2 * self.block_ms, 1000))

    @property
    def owner_ttl_s(self) -> int:
        """Lifetime of a job's owner hash, renewed by the heartbeat while the job runs."""
        return max(self.result_ttl, 10 * self.claim_idle_ms // 1000, 60)

    @property
    def socket_timeout_s(self) -> float:
        """Longer than any BLOCK we issue, so a blocking read never times out client-side."""
        return self.block_ms / 1000 + 5.0
