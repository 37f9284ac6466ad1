"""Back-pressure instead of an unbounded queue: with a bound, a request is refused (429, with
`Retry-After`) while as many jobs as the bound are unfinished for its model (`XLEN` of the streams
its workers read: its model's and the model-less ones)."""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio

from qworker_client.gateway.errors import APIError
from qworker_client.protocol import Keys


class Gate:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys, max_queued: int | None,
                 retry_after_s: int) -> None:
        self.client = client
        self.keys = keys
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s

    async def unfinished(self, models: Iterable[str | None]) -> int:
        """The unfinished jobs of these models (None: the model-less ones)."""
        streams = sorted({s for model in models for s in self.keys.streams_for(model)})
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
        return sum(await pipe.execute())

    async def admit(self, model: str, jobs: int) -> None:
        """Raise 429 when `jobs` more for `model` would pass the bound (no bound: no look)."""
        if self.max_queued is None:
            return
        unfinished = await self.unfinished([model])
        if unfinished + jobs > self.max_queued:
            raise APIError(
                429, f"the queue is full ({unfinished} unfinished jobs, at most "
                f"{self.max_queued}); retry later", type="rate_limit_error",
                code="queue_full", headers={"retry-after": str(self.retry_after_s)},
            )
