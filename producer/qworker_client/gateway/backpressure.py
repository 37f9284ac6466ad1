"""Back-pressure instead of an unbounded queue: with a bound, a request is refused (429, with
`Retry-After`) while as many jobs as the bound are unfinished (`XLEN` of the job streams)."""

from __future__ import annotations

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
        self.seen = 0  # unfinished jobs at the last look

    async def unfinished(self) -> int:
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.keys.jobs)
        pipe.xlen(self.keys.requeue)
        self.seen = sum(await pipe.execute())
        return self.seen

    async def admit(self, jobs: int) -> None:
        """Raise 429 when `jobs` more would pass the bound."""
        unfinished = await self.unfinished()
        if self.max_queued is not None and unfinished + jobs > self.max_queued:
            raise APIError(
                429, f"the queue is full ({unfinished} unfinished jobs, at most "
                f"{self.max_queued}); retry later", type="rate_limit_error",
                code="queue_full", headers={"retry-after": str(self.retry_after_s)},
            )
