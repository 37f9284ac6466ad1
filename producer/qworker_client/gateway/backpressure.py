"""Back-pressure instead of an unbounded queue: with a bound, a request is refused (429, with
`Retry-After`) while as many jobs as the bound are unfinished for its model (`XLEN` of the streams
its workers read: its model's and the model-less ones).

The depth is looked up at most every `LOOK_EVERY_S` for a model, in the background (one lookup at
a time; a request waits only for a model's first, or before it is refused), and the jobs this
gateway admitted since are added to it: a lookup per request (a dozen XLENs) cost about as much
CPU as the rest of a short request. A refusal always looks again, so a queue that drained admits
at once; what other gateways admitted meanwhile is seen at the next lookup (they may pass the
bound by what they admit in that time)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import redis.asyncio

from qworker_client.gateway.errors import APIError
from qworker_client.protocol import Keys

LOOK_EVERY_S = 0.1


class Gate:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys, max_queued: int | None,
                 retry_after_s: int) -> None:
        self.client = client
        self.keys = keys
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self._depth: dict[str, tuple[float, int]] = {}  # model -> (looked up at, jobs since)
        self._lookups: dict[str, asyncio.Future[None]] = {}  # model -> its lookup under way

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
        known = self._depth.get(model)
        if known is None or known[1] + jobs > self.max_queued:  # the first, or a refusal
            await asyncio.shield(self._lookup(model))  # one cancelled leaves it to the others
        elif time.monotonic() - known[0] >= LOOK_EVERY_S:
            self._lookup(model)
        looked_at, unfinished = self._depth[model]
        if unfinished + jobs > self.max_queued:
            raise APIError(
                429, f"the queue is full ({unfinished} unfinished jobs, at most "
                f"{self.max_queued}); retry later", type="rate_limit_error",
                code="queue_full", headers={"retry-after": str(self.retry_after_s)},
            )
        self._depth[model] = looked_at, unfinished + jobs

    def _lookup(self, model: str) -> asyncio.Future[None]:
        """The lookup of `model`'s depth under way, or a new one."""
        lookup = self._lookups.get(model)
        if lookup is None:
            lookup = self._lookups[model] = asyncio.ensure_future(self._look(model))
            lookup.add_done_callback(_retrieved)  # a failed one nobody awaited: not logged
        return lookup

    async def _look(self, model: str) -> None:
        try:
            looked_at = time.monotonic()
            self._depth[model] = looked_at, await self.unfinished([model])
        finally:
            del self._lookups[model]


def _retrieved(lookup: asyncio.Future[None]) -> None:
    if not lookup.cancelled():
        lookup.exception()
