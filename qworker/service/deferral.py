"""Deferral: a job read before its time (`delay_ms`, `not_before_ms`) is moved to its model's
delayed set instead of being taken (lua_delayed.DEFER), in one round trip for all of a read's
delayed jobs; the promoter (promoter.py) queues it again when its time comes. Only new jobs are:
an entry of a requeue stream had started, whatever its fields say."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis

from qworker.service.config import ServiceConfig
from qworker.service.errors import job_error
from qworker.service.job import Entry, Reject
from qworker.service.logs import get_logger
from qworker.service.scripts import Scripts
from qworker_client.protocol import INTERNAL, INVALID_REQUEST, Job, Keys

DELAY_FIELDS = (b"delay_ms", b"not_before_ms")
NOT_OURS, DUE, DELAYED, DUPLICATE = -1, 0, 1, 2  # the script's replies


class Deferral:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig,
                 scripts: Scripts) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.scripts = scripts
        self.log = get_logger(worker=config.name)
        self.deferred = 0  # jobs this worker moved to a delayed set (tests, metrics)

    def defer(self, items: Sequence[tuple[Entry, Job]]
              ) -> tuple[list[tuple[Entry, Job]], list[Reject]]:
        """The jobs to take now (their time has come, or they have none), and the rejects (a
        duplicate of a delayed job, Redis refusing its keys); the others are delayed (acked)."""
        delayed = [(e, j) for e, j in items if self._delayed(e, j)]
        if not delayed:
            return list(items), []
        replies = self._round_trip(delayed)
        if any(isinstance(reply, redis.exceptions.NoScriptError) for reply in replies):
            Scripts.load(self.client)  # Redis restarted (or flushed its scripts): again, whole
            replies = self._round_trip(delayed)
        outcome = {e.entry_id: reply for (e, _), reply in zip(delayed, replies, strict=True)}
        runnable: list[tuple[Entry, Job]] = []
        rejects: list[Reject] = []
        for entry, job in items:
            reply = outcome.get(entry.entry_id, [DUE, 0])
            error = job_error(reply)
            job_id = job.id or entry.entry_id
            if error is not None:
                rejects.append(Reject(entry, INTERNAL, f"Redis refused this job's keys: {error}",
                                      job_id, job=job))
            elif int(reply[0]) == DUE:
                runnable.append((entry, job))
            elif int(reply[0]) == DUPLICATE:
                rejects.append(Reject(entry, INVALID_REQUEST,
                                      f"duplicate: job {job_id} is delayed already", None))
            elif int(reply[0]) == DELAYED:
                self.deferred += 1
                self.log.info("delayed", job_id=job_id, due_ms=int(reply[1]))
        return runnable, rejects

    def _delayed(self, entry: Entry, job: Job) -> bool:
        return ((job.delay_ms is not None or job.not_before_ms is not None)
                and not self.keys.is_requeue(entry.stream))

    def _round_trip(self, items: Sequence[tuple[Entry, Job]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for entry, job in items:
            job_id = job.id or entry.entry_id
            model = self.keys.stream_model(entry.stream)
            self.scripts.defer(pipe, stream=entry.stream, delayed=self.keys.delayed_of(model),
                               delayed_jobs=self.keys.delayed_jobs_of(model),
                               group=self.config.group, consumer=self.config.name,
                               entry_id=entry.entry_id, job_id=job_id,
                               delay_ms=job.delay_ms or 0, not_before_ms=job.not_before_ms or 0,
                               job_json=self._stored(entry, job_id))
        return pipe.execute(raise_on_error=False)

    def _stored(self, entry: Entry, job_id: str) -> str:
        """The job as its delayed set keeps it: its band (its stream's), then its fields but the
        delay ones (queued again, it runs), its id among them."""
        fields = {k: v for k, v in entry.fields.items() if k not in DELAY_FIELDS}
        fields.setdefault(b"id", job_id.encode())
        flat = [self.keys.stream_band(entry.stream)]
        for key, value in fields.items():
            flat += [_text(key), _text(value)]
        return json.dumps(flat, ensure_ascii=False, separators=(",", ":"))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
