"""The worker's alone key: which job it does something with alone right now (see
docs/operating.md, "Poison jobs", and `take_owner` in scripts.py)."""

from __future__ import annotations

import redis

from qworker.service.scripts import alone_key
from qworker_client.protocol import Keys


class Alone:
    def __init__(self, client: redis.Redis, keys: Keys, token: str, ttl_s: int) -> None:
        self.client = client
        self.key = alone_key(keys, token)
        self.ttl_s = ttl_s
        self.job_id: str | None = None  # the job the key names (None: no key)

    def move(self, job_id: str | None) -> None:
        """Records, before it happens, that this worker does something with `job_id` alone (None:
        with no job alone). A worker that dies or stalls meanwhile leaves the key behind: the
        job's next owner charges it a crash, and the other jobs the worker held are excused that
        delivery (scripts.TAKE_OWNER)."""
        if job_id == self.job_id:
            return
        if job_id is None:
            self.client.delete(self.key)
        else:
            self.client.set(self.key, job_id, ex=self.ttl_s)
        self.job_id = job_id
