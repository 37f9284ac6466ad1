"""One reader for every output stream a gateway process follows: a single XREAD a turn over all
of them (instead of one blocking read per open response), each job's new entries handed to its
follower's mailbox in stream order.

A follower that joins while a read is blocked waits for that read to return: reads block at most
`block_ms`, short, so a new response's first token is late by that much at worst.

The read goes out on the hub's own connection, held from the pool for as long as the hub reads,
packed here (each stream's key packed once, when it is followed): redis-py's command path (its
pool checkout, its packing of every key and id, its retry and observability wrappers) was a tenth
of the gateway's CPU. The reply is taken as the wire gives it (each entry's fields a flat list),
not through redis-py's XREAD callback: its dict per entry and its RESP3-to-RESP2 reshaping were a
fifth of the read.

A follower's `put_nowait` is called in the read loop with each job's new entries. A streamed
response takes them there and then (`live.LiveStream`: framed and written, no task woken); a
`Mailbox` keeps them for a task that takes what the reads brought it since it last looked, in one
wake-up (an asyncio.Queue woke it once per item, through several layers of Python).

`interval_s` paces the reads: one starts at most once per interval (a read that found nothing
has already waited). Each read then brings several tokens of a busy stream, so the reads, the
wake-ups and the sends (one per stream per read) cost less per token; a token waits at most one
interval more.

An error reply to the read is one stream's (a key that is not a stream; an id Redis refuses,
though the routes check ids first), never every follower's: the read's halves are read again,
not blocking, until each stream that fails is alone, as the engine bisects a failing step; that
job ends with a `bad_event` error for its followers, and the others get their entries. A job
whose state vanished from Redis ends with `lost_state` (`vanished.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

from qworker_client.connect import READ_COUNT
from qworker_client.gateway.streams import vanished
from qworker_client.gateway.streams.vanished import Queued
from qworker_client.multiplex import unreadable_stream
from qworker_client.protocol import ErrorEvent, Keys, event_to_fields
from qworker_client.retry import TRANSIENT_ERRORS, Backoff

log = logging.getLogger("qworker.gateway")

BLOCK_MS = 20
GIVE_UP_S = 60.0  # a dropped connection is retried this long, then every follower gets the error


Entry = Sequence[Any]  # [entry id, [field, value, field, value, ...]], as XREAD replies
Entries = list[Entry]
# what a follower gets: (job id, its new entries), or the error that ended every read
Item = tuple[str, Entries] | BaseException


class Follower(Protocol):
    def put_nowait(self, item: Item) -> None:
        """Called by the hub's read loop: it must not raise."""


class Mailbox:
    """A follower's items, put by the hub's reads, taken all at once by the follower."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self) -> None:
        """Made in the loop that takes from it."""
        self._items: list[Item] = []
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Item]:
        """Every item put since the last take, waiting for one if there is none."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


@dataclass
class _Follow:
    last_id: str
    mailbox: Follower


class Hub:
    def __init__(self, client: redis.asyncio.Redis, keys: Keys, block_ms: int = BLOCK_MS,
                 interval_s: float = 0.0) -> None:
        assert interval_s >= 0, interval_s
        self.client = client
        self.keys = keys
        self.block_ms = block_ms
        self.interval_s = interval_s
        self._follows: dict[str, list[_Follow]] = {}  # several readers may follow one job
        self._packed_keys: dict[str, bytes] = {}  # job id -> its output key, packed
        self._queued: dict[str, Queued | None] = {}  # job id -> where it was queued, if known
        self._heard: dict[str, float] = {}  # job id -> when it last showed it is there
        self._joined = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._closed = False
        self._out_prefix = keys.out("")
        self._conn: AbstractConnection | None = None  # the reads', from the client's pool
        self._read_head = b"".join(_bulk(str(arg).encode()) for arg in (
            "XREAD", "COUNT", READ_COUNT, "BLOCK", block_ms, "STREAMS"))
        self._peek_head = b"".join(_bulk(str(arg).encode()) for arg in (
            "XREAD", "COUNT", READ_COUNT, "STREAMS"))

    def follow(self, job_ids: dict[str, str], mailbox: Follower,
               queued: dict[str, Queued] | None = None) -> None:
        """Put each job's new entries (read after the given entry id) in `mailbox`, as
        (job id, entries), until `drop`: a `Mailbox`, or a follower that takes them as they
        come, in the read loop. `queued`: where the jobs were queued, to tell one that vanished
        (`vanished.py`)."""
        now = time.monotonic()
        for job_id, after in job_ids.items():
            if job_id not in self._follows:
                self._follows[job_id] = []
                self._packed_keys[job_id] = _bulk((self._out_prefix + job_id).encode())
                self._heard[job_id] = now
            position = (queued or {}).get(job_id)
            if position is not None or job_id not in self._queued:
                self._queued[job_id] = position
            self._follows[job_id].append(_Follow(after, mailbox))
        self._joined.set()
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="gateway-hub")
        if self._watch is None or self._watch.done():
            self._watch = loop.create_task(self._look_for_vanished(), name="gateway-hub-watch")

    def drop(self, job_ids: list[str], mailbox: Follower) -> None:
        """Stop putting these jobs' entries in `mailbox`."""
        for job_id in job_ids:
            kept = [f for f in self._follows.get(job_id, ()) if f.mailbox is not mailbox]
            if kept:
                self._follows[job_id] = kept
            else:
                self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        self._follows.pop(job_id, None)
        self._packed_keys.pop(job_id, None)
        self._queued.pop(job_id, None)
        self._heard.pop(job_id, None)

    async def close(self) -> None:
        """Stop reading. The loop also stops by itself once closed: a cancel that reaches it
        inside a read can be swallowed there, and the loop went on to wait for a follower that
        never came."""
        self._closed = True
        self._joined.set()
        for task in (self._task, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._conn is not None:
            await self.client.connection_pool.release(self._conn)
            self._conn = None

    async def _run(self) -> None:
        backoff = Backoff(give_up_s=GIVE_UP_S)
        while not self._closed:
            if not self._follows:
                self._joined.clear()
                await self._joined.wait()
                continue
            asked = {job_id: _earliest(fs) for job_id, fs in self._follows.items()}
            started = time.monotonic()
            try:
                brought = await self._read_all(asked)
            except TRANSIENT_ERRORS as exc:
                try:
                    delay = backoff.failed(exc)
                except Exception as final:
                    self._fail(final)
                    continue
                await asyncio.sleep(delay)
                continue
            except Exception as exc:  # a bug: no follower must wait for a read that is not
                self._fail(exc)
                continue
            backoff = Backoff(give_up_s=GIVE_UP_S)
            if brought and self.interval_s:
                await asyncio.sleep(started + self.interval_s - time.monotonic())

    async def _read_all(self, asked: dict[str, str]) -> bool:
        """`_read` of every stream followed, delivered; True when it brought anything (or
        failed: the next read is paced as after one that did)."""
        try:
            reply = await self._read(asked)
        except ResponseError as exc:
            await self._isolate(list(asked.items()), exc)
            return True
        self._deliver(reply, asked)
        return bool(reply)

    async def _isolate(self, failed: list[tuple[str, str]], exc: ResponseError) -> None:
        """After an error reply to a read of these streams: halves read again, not blocking,
        until each stream that fails is alone; its job ends with the error, the others' entries
        are delivered. A job dropped meanwhile is left out."""
        parts = [(failed, exc)]
        while parts:
            part, error = parts.pop()
            if len(part) == 1:
                job_id = part[0][0]
                if job_id in self._follows:
                    log.warning("job %s: its output stream cannot be read: %s", job_id, error)
                    self._end(job_id, unreadable_stream(error))
                continue
            half = len(part) // 2
            for piece in (part[:half], part[half:]):
                live = {job_id: after for job_id, after in piece if job_id in self._follows}
                if not live:
                    continue
                try:
                    reply = await self._read(live, block=False)
                except ResponseError as piece_error:
                    parts.append((list(live.items()), piece_error))
                else:
                    self._deliver(reply, live)

    async def _read(self, asked: dict[str, str], block: bool = True) -> object:
        """One XREAD of these streams (blocking at most `block_ms`, or not at all), each after
        its earliest follower's position."""
        if self._conn is None:
            self._conn = await self.client.connection_pool.get_connection()
        packed = self._packed_keys
        head, arity = (self._read_head, 6) if block else (self._peek_head, 4)
        # one buffer: written as its ~500 pieces (writev), the command took several times longer
        command = b"".join([b"*%d\r\n" % (arity + 2 * len(asked)), head,
                            *[packed[job_id] for job_id in asked],
                            *[_bulk(entry_id.encode()) for entry_id in asked.values()]])
        await self._conn.send_packed_command(command, check_health=False)
        return await self._conn.read_response()  # an error reply raises, a dropped one too

    def _deliver(self, reply: object, asked: dict[str, str]) -> None:
        """Each follower gets the entries past its position, if the read started at or before
        it (one that joined behind it while the read was out waits for the next read)."""
        now = time.monotonic()
        for key, entries in _by_stream(reply):
            job_id = key.removeprefix(self._out_prefix)
            follows = self._follows.get(job_id)
            if not follows:  # dropped while the read was out
                continue
            self._heard[job_id] = now
            asked_id = asked[job_id]
            for follow in follows:
                new = entries if follow.last_id == asked_id else _past(entries, follow.last_id,
                                                                        asked_id)
                if new:
                    follow.last_id = new[-1][0]
                    follow.mailbox.put_nowait((job_id, new))

    def _end(self, job_id: str, event: ErrorEvent) -> None:
        """End a job for each of its followers with `event`, as if read from its stream (at the
        follower's position), and stop reading it."""
        fields = [item for pair in event_to_fields(event).items() for item in pair]
        follows = self._follows.get(job_id, [])
        self._forget(job_id)
        for follow in follows:
            follow.mailbox.put_nowait((job_id, [[follow.last_id, fields]]))

    async def _look_for_vanished(self) -> None:
        """Every `EVERY_S`: the jobs quiet for `QUIET_S` are looked up; those of which nothing
        is left end with `lost_state`."""
        while not self._closed:
            await asyncio.sleep(vanished.EVERY_S)
            try:
                await self._look_up(time.monotonic() - vanished.QUIET_S)
            except Exception:  # a bug: the reads go on, only this round is lost
                log.exception("looking up the quiet jobs failed")

    async def _look_up(self, since: float) -> None:
        """Look up the jobs not heard of since `since` (at most `MAX_LOOKUPS`, the longest quiet
        first); end those gone and not heard of meanwhile, count the others as heard now."""
        quiet = [job_id for job_id, heard in self._heard.items() if heard <= since]
        if len(quiet) > vanished.MAX_LOOKUPS:
            quiet = heapq.nsmallest(vanished.MAX_LOOKUPS, quiet, key=self._heard.__getitem__)
        if not quiet:
            return
        gone = await vanished.vanished(self.client.connection_pool, self.keys,
                                       {job_id: self._queued.get(job_id) for job_id in quiet})
        if gone is None:  # Redis away: looked up again next round
            return
        for job_id in gone:
            if self._heard.get(job_id, math.inf) <= since:
                log.warning("job %s: its state vanished from Redis: ended (lost_state)", job_id)
                self._end(job_id, vanished.LOST)
        now = time.monotonic()
        for job_id in quiet:
            if job_id in self._heard:
                self._heard[job_id] = now

    def _fail(self, exc: BaseException) -> None:
        """Redis stayed away: every follower gets the error, and is dropped."""
        mailboxes = {id(f.mailbox): f.mailbox for fs in self._follows.values() for f in fs}
        for mailbox in mailboxes.values():
            mailbox.put_nowait(exc)
        for job_id in list(self._follows):
            self._forget(job_id)


def _bulk(arg: bytes) -> bytes:
    """One argument of a command as RESP packs it."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _by_stream(reply: Any) -> Iterable[tuple[str, Entries]]:
    """(key, entries) of an XREAD reply: a RESP3 map, or RESP2's [[key, entries], ...]."""
    if not reply:
        return ()
    return reply.items() if isinstance(reply, dict) else reply


def _earliest(follows: list[_Follow]) -> str:
    if len(follows) == 1:
        return follows[0].last_id
    return min((f.last_id for f in follows), key=_order)


def _past(entries: Entries, after: str, asked: str) -> Entries:
    """The entries past `after`, or none if the read started past it."""
    position = _order(after)
    if position < _order(asked):
        return []
    return [e for e in entries if _order(e[0]) > position]


def _order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as it sorts ("0-0" first)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
