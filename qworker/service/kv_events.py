"""KV events on Redis (`--kv-events`; docs/protocol.md, "KV events"): at each loop turn the
engine's KV events since the last one go as one entry of `<prefix>:kv_events` (`XADD ... MAXLEN ~
kv_events_maxlen`), written on a thread of its own so that the engine never waits on Redis.

An entry not written (Redis down) is written again, the same, after a backoff, and nothing newer
goes before it; meanwhile the engine's log keeps what comes, within its bound (past it the engine
drops its prefix cache and says so: engine/kv_events.py), so the stream is never wrong. A refusal
(an ACL without the key, a key of another type) is logged and ends the events, not the worker. At
a clean exit the worker says `AllBlocksCleared`: its cache is gone with it.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from qworker.engine.kv_events import AllBlocksCleared, KVEvent
from qworker.service.backoff import Backoff
from qworker.service.config import ServiceConfig
from qworker.service.engine_api import EngineLike
from qworker.service.errors import is_transient, short
from qworker_client.protocol import Keys

Fields = dict[str, str]
EXIT_WAIT_S = 2.0  # the longest an exit waits for the entry under way


class KVEventPublisher:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig,
                 engine: EngineLike, token: str, log: Any) -> None:
        self.client = client
        self.key = keys.kv_events
        self.maxlen = config.kv_events_maxlen
        self.engine = engine
        self.log = log
        self.identity = {"worker": config.name, "token": token, "model": config.served_model or ""}
        self.backoff = Backoff(config.backoff_min_s, config.backoff_max_s)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{config.name}-kv-events")
        self._flight: Future[Any] | None = None
        self._unsent: Fields | None = None  # the entry under way or to write again
        self._seq = 0  # the next entry's
        self._failing = False  # said once per spell of failures
        self.stopped = False
        engine.record_kv_events()

    def turn(self) -> None:
        """Settles the entry under way if its reply came; then writes the next one: the entry
        that failed (once its backoff is over), else the events since the last turn, if any."""
        if self.stopped or (self._flight is not None and not self._settled()):
            return
        if self._unsent is None:
            events = self.engine.take_kv_events()
            if not events:
                return
            self._unsent = self._entry(events)
        if self.backoff.ready(time.monotonic()):
            self._flight = self._thread.submit(self._write, self._unsent)

    def close(self) -> None:
        """At a clean exit: the entry under way awaited (briefly), then `AllBlocksCleared`."""
        if self._flight is not None:
            with contextlib.suppress(Exception):  # whatever it was, the exit goes on
                self._flight.result(timeout=EXIT_WAIT_S)
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self.stopped:
            return
        try:
            self._write(self._entry([AllBlocksCleared()]))
        except redis.RedisError as exc:  # a router forgets the worker once its key expires
            self.log.warning("could not say the KV cache is gone", error=short(exc, 200))

    def _entry(self, events: list[KVEvent]) -> Fields:
        medium = self.engine.kv_medium
        batch = {"ts": time.time(), "events": [event.wire(medium) for event in events],
                 "data_parallel_rank": None}
        fields = {**self.identity, "seq": str(self._seq),
                  "batch": json.dumps(batch, separators=(",", ":"))}
        self._seq += 1
        return fields

    def _write(self, fields: Fields) -> None:
        self.client.xadd(self.key, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]

    def _settled(self) -> bool:
        """The reply of the entry under way, if it came (True): written, or failed (kept to
        write again, or, refused for good, the end of the events)."""
        flight = self._flight
        if flight is None or not flight.done():
            return flight is None
        self._flight = None
        try:
            flight.result()
        except redis.RedisError as exc:
            self._failed(exc)
            return True
        self._unsent, self._failing = None, False
        self.backoff.succeeded()
        return True

    def _failed(self, exc: redis.RedisError) -> None:
        if not is_transient(exc):
            self.log.error("Redis refuses the KV events; publishing none from now on",
                           key=self.key, error=short(exc, 200))
            self.stopped = True
            self.engine.record_kv_events(None)
            return
        delay = self.backoff.failed(time.monotonic())
        if not self._failing:
            self.log.warning("could not write KV events, retrying", error=short(exc, 200),
                             retry_in_s=round(delay, 3))
        self._failing = True
