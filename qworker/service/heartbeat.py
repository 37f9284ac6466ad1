"""Heartbeat: keeps this worker's in-flight entries owned (re-claimed, so their idle time never
reaches claim_idle while we live), renews their owner hashes, and marks the worker alive."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import redis

from qworker.protocol import Keys, WorkerInfo
from qworker.service.config import ServiceConfig
from qworker.service.job import ActiveJob


class Heartbeat:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.last_beat = float("-inf")

    def due(self, now: float) -> bool:
        return now - self.last_beat >= self.config.heartbeat_s

    def beat(self, now: float, jobs: Iterable[ActiveJob], info: WorkerInfo) -> None:
        """One round trip. XCLAIM ... JUSTID resets idle time without counting a delivery."""
        by_stream: dict[str, list[str]] = defaultdict(list)
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            by_stream[job.entry.stream].append(job.entry.entry_id)
            pipe.expire(self.keys.owner(job.job_id), self.config.owner_ttl_s)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, self.config.group, self.config.name, 0, ids, justid=True)
        pipe.set(self.keys.worker(self.config.name), info.model_dump_json(),
                 px=self.config.liveness_ttl_ms)
        pipe.execute()
        self.last_beat = now

    def leave(self) -> None:
        """Clean exit: the worker's key goes at once (else it expires)."""
        self.client.delete(self.keys.worker(self.config.name))
