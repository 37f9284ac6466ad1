"""Heartbeat: a thread that keeps this worker's in-flight entries owned (re-claimed, so their idle
time never reaches claim_idle while we live), renews their owner hashes, and marks the worker
alive, every `heartbeat_s`, whatever the loop is doing (a long step, a slow admission, a backoff).

The loop publishes what it holds (`track`: its jobs, and the entries it has read and not yet
admitted) and that it makes progress (`progress`, once per turn and per admitted job). Entries
that the loop's round trip reads beside an engine step reach the loop only when the step ends,
which may be far longer than claim_idle: the Redis thread hands them over at once (`hold`), so
they are owned from the moment Redis delivered them until the loop's own snapshot has them.

When the loop has not made progress for `stall_timeout_s` it is stuck, not busy: the thread stops
beating, so peers reclaim its jobs once they are idle for claim_idle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from qworker.service.config import ServiceConfig
from qworker.service.errors import CannotWork, cannot_work, is_group_gone, is_transient, short
from qworker.service.job import Entry
from qworker.service.logs import get_logger
from qworker.service.scripts import Scripts
from qworker_client.protocol import Keys

RETRY_S = 0.25  # after a failed beat, try again this soon (capped at heartbeat_s)


@dataclass(frozen=True)
class Held:
    """One in-flight entry of a job, as the heartbeat sees it."""

    stream: str
    entry_id: str
    job_id: str


class Heartbeat:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig, scripts: Scripts,
                 token: str) -> None:
        self.client = client  # thread-safe: each command takes its own pooled connection
        self.keys = keys
        self.config = config
        self.scripts = scripts
        self.token = token
        self.log = get_logger(worker=config.name)
        self._lock = threading.Lock()
        self._held: tuple[Held, ...] = ()
        self._read: tuple[Held, ...] = ()  # read by a round trip, not yet in the loop's snapshot
        self._info = "{}"
        self._progress = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stalled = False
        self.beats = 0  # successful beats (tests, metrics)
        self.last_error = ""
        # Set when Redis refuses the beat itself (an ACL without the worker key or the job
        # stream): the loop raises it, since a worker that cannot beat loses every job it takes.
        self.fatal: CannotWork | None = None

    # ------------------------------------------------------------------ fed by the loop

    def track(self, held: Iterable[Held], info_json: str | None = None) -> None:
        snapshot = tuple(held)
        ids = {h.entry_id for h in snapshot}
        with self._lock:
            self._held = snapshot
            self._read = tuple(h for h in self._read if h.entry_id not in ids)
            if info_json is not None:
                self._info = info_json

    def hold(self, entries: Iterable[Entry]) -> None:
        """Entries just read for the loop (from the Redis thread): kept owned until the loop
        tracks them."""
        more = tuple(Held(e.stream, e.entry_id, e.entry_id) for e in entries)
        if more:
            with self._lock:
                self._read += more

    def progress(self) -> None:
        self._progress = time.monotonic()

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"heartbeat:{self.config.name}")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.socket_timeout_s + 5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = self.config.heartbeat_s
            if self._loop_stuck():
                pass
            elif not self.beat():
                wait = min(RETRY_S, wait)
            self._stop.wait(wait)

    def _loop_stuck(self) -> bool:
        stuck = time.monotonic() - self._progress > self.config.stall_timeout_s
        if stuck != self.stalled:
            self.stalled = stuck
            if stuck:
                self.log.error("loop stalled: no progress, heartbeat stopped so peers reclaim "
                               "its jobs", stall_timeout_s=self.config.stall_timeout_s)
            else:
                self.log.warning("loop making progress again, heartbeat resumed")
        return stuck

    def beat(self) -> bool:
        """One round trip (the `beat` script); False when Redis failed it."""
        with self._lock:
            held, info = self._held + self._read, self._info
        try:
            self._send(held, info)
        except redis.exceptions.NoScriptError:
            try:
                Scripts.load(self.client)
                self._send(held, info)
            except redis.RedisError as exc:
                return self._failed(exc)
        except redis.RedisError as exc:
            return self._failed(exc)
        self.beats += 1
        if self.last_error:
            self.log.info("heartbeat ok again")
            self.last_error = ""
        return True

    def _send(self, held: tuple[Held, ...], info: str) -> None:
        self.scripts.beat(
            self.client, group=self.config.group, consumer=self.config.name, token=self.token,
            owner_ttl_s=self.config.owner_ttl_s, worker_key=self.keys.worker(self.config.name),
            info=info, liveness_ms=self.config.liveness_ttl_ms,
            entries=[(h.stream, h.entry_id, self.keys.owner(h.job_id)) for h in held])

    def _failed(self, exc: BaseException) -> bool:
        if (isinstance(exc, redis.ResponseError) and not is_transient(exc)
                and not is_group_gone(exc)):
            self.fatal = cannot_work(exc)
        error = short(exc)
        if error != self.last_error:  # once per kind of failure, not once per retry
            self.log.warning("heartbeat failed, retrying", error=error)
        self.last_error = error
        return False

    def leave(self) -> None:
        """Clean exit: the thread stops and the worker's key goes at once (else it expires)."""
        self.stop()
        self.client.delete(self.keys.worker(self.config.name))
