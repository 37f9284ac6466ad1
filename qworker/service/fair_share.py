"""What a worker's fair read needs besides its streams: the keys, and whether any tenant has a
tokens-per-minute quota (field `:quotas` of `<prefix>:tenants`, read at most once a second)."""

from __future__ import annotations

import contextlib
import time

import redis

from qworker_client.protocol import QUOTAS_FIELD, Keys

LOOK_EVERY_S = 1.0


class FairShare:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._quotas = False
        self._looked = -LOOK_EVERY_S

    def quotas_on(self) -> bool:
        now = time.monotonic()
        if now - self._looked >= LOOK_EVERY_S:
            self._looked = now
            with contextlib.suppress(redis.RedisError):  # the read itself will say what is wrong
                self._quotas = bool(self.client.hexists(self.keys.tenants, QUOTAS_FIELD))
        return self._quotas
