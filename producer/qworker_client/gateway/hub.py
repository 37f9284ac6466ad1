"""One reader for every output stream a gateway process follows: a single XREAD a turn over all
of them (instead of one blocking read per open response), each job's new entries handed to its
follower's queue in stream order.

A follower that joins while a read is blocked waits for that read to return: reads block at most
`block_ms`, short, so a new response's first token is late by that much at worst.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import redis.asyncio
from redis.typing import KeyT, StreamIdT

from qworker_client.connect import READ_COUNT
from qworker_client.multiplex import Entries, xread_by_stream
from qworker_client.protocol import Keys
from qworker_client.retry import TRANSIENT_ERRORS, Backoff

BLOCK_MS = 20
GIVE_UP_S = 60.0  # a dropped connection is retried this long, then every follower gets the error


# each follower's queue: (job id, its new entries), or the error that ended every read
Queue = asyncio.Queue[tuple[str, Entries] | BaseException]


@dataclass
class _Follow:
    last_id: str
    queue: Queue = field(default_factory=asyncio.Queue)


class Hub:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys, block_ms: int = BLOCK_MS) -> None:
        self.client = client
        self.keys = keys
        self.block_ms = block_ms
        self._follows: dict[str, _Follow] = {}
        self._joined = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._out_prefix = keys.out("")

    def follow(self, job_ids: dict[str, str], queue: Queue) -> None:
        """Put each job's new entries (read after the given entry id) on `queue`, as
        (job id, entries), until `drop`."""
        for job_id, after in job_ids.items():
            self._follows[job_id] = _Follow(after, queue)
        self._joined.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gateway-hub")

    def drop(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self._follows.pop(job_id, None)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        backoff = Backoff(give_up_s=GIVE_UP_S)
        while True:
            if not self._follows:
                self._joined.clear()
                await self._joined.wait()
            streams: dict[KeyT, StreamIdT] = {self.keys.out(j): f.last_id
                                               for j, f in self._follows.items()}
            try:
                reply = await self.client.xread(streams, count=READ_COUNT, block=self.block_ms)
            except TRANSIENT_ERRORS as exc:
                try:
                    delay = backoff.failed(exc)
                except Exception as final:
                    self._fail(final)
                    continue
                await asyncio.sleep(delay)
                continue
            except Exception as exc:  # e.g. an output key that is not a stream: nobody can read
                self._fail(exc)
                continue
            backoff = Backoff(give_up_s=GIVE_UP_S)
            self._deliver(reply)

    def _deliver(self, reply: object) -> None:
        for key, entries in xread_by_stream(reply):
            job_id = key.removeprefix(self._out_prefix)
            follow = self._follows.get(job_id)
            if follow is None or not entries:
                continue  # dropped while the read was out
            follow.last_id = entries[-1][0]
            follow.queue.put_nowait((job_id, entries))

    def _fail(self, exc: BaseException) -> None:
        """Redis stayed away: every follower gets the error, and is dropped."""
        for follow in {id(f.queue): f for f in self._follows.values()}.values():
            follow.queue.put_nowait(exc)
        self._follows.clear()
