"""The promoter: every worker moves the delayed jobs whose time has come back to their streams
(lua_delayed.PROMOTE), for each delayed set it serves: its model's and the model-less one. It
looks every `delayed_poll_ms` (another producer may have queued a job due sooner), and as soon as
the next job it knows of is due; an idle worker blocks its read no longer than that.

Redis refusing a delayed set's keys (an ACL from before delayed jobs, a foreign key of the wrong
type) costs only that set: said once in the log, tried again at the next look; the worker goes on
with the rest of its work."""

from __future__ import annotations

import redis

from qworker.service.config import ServiceConfig
from qworker.service.errors import job_error
from qworker.service.logs import get_logger
from qworker.service.scripts import Scripts
from qworker_client.protocol import BANDS, Keys

BATCH = 500  # jobs moved by one script call (a longer call would hold Redis up)


class Promoter:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig,
                 scripts: Scripts) -> None:
        self.client = client
        self.scripts = scripts
        models = ([keys.slot] if keys.slot is not None  # a Cluster: only its model's slot
                  else [config.served_model, None] if config.served_model else [None])
        self.sets = [(keys.delayed_of(m), keys.delayed_jobs_of(m),
                      tuple(keys.jobs_of(m, band) for band in BANDS)) for m in models]
        self.poll_s = config.delayed_poll_ms / 1000
        self.next_at = float("-inf")  # time.monotonic() of the next look
        self.promoted = 0  # jobs moved by this worker (tests, metrics)
        self._refused: dict[str, str | None] = {}  # delayed set -> the error said of it
        self.log = get_logger(worker=config.name)

    def wait_s(self, now: float) -> float:
        """How long until the next look."""
        return max(0.0, self.next_at - now)

    def promote(self, now: float) -> int:
        """Move what is due, if it is time to look (`now`: time.monotonic()); how many moved."""
        if now < self.next_at:
            return 0
        moved, wait_s = 0, self.poll_s
        for delayed, delayed_jobs, streams in self.sets:
            n, next_ms = self._promote_set(delayed, delayed_jobs, streams)
            moved += n
            if next_ms >= 0:
                wait_s = min(wait_s, next_ms / 1000)
        self.next_at = now + wait_s
        self.promoted += moved
        return moved

    def _promote_set(self, delayed: str, delayed_jobs: str, streams: tuple[str, ...]
                     ) -> tuple[int, int]:
        moved = 0
        while True:
            try:
                n, next_ms = self.scripts.promote(self.client, delayed=delayed,
                                                  delayed_jobs=delayed_jobs, streams=streams,
                                                  count=BATCH)
            except redis.ResponseError as exc:
                if job_error(exc) != self._refused.get(delayed):  # raises what is not the set's
                    self.log.error("cannot queue delayed jobs again: Redis refuses their keys",
                                   delayed=delayed, error=str(exc)[:200])
                self._refused[delayed] = job_error(exc)
                return moved, -1
            self._refused.pop(delayed, None)
            moved += n
            if n < BATCH:
                return moved, next_ms
