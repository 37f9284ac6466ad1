"""Intake: read entries only as fast as the engine admits them, reclaim idle ones, screen them
(poison, validation, deadline), take ownership and read back what was already shown, and
dead-letter what cannot run."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from qworker.protocol import (
    DEAD_META_FIELDS,
    EXPIRED,
    INVALID_REQUEST,
    TOO_MANY_DELIVERIES,
    ErrorEvent,
    Job,
    JobValidationError,
    Keys,
    entry_ms,
    event_to_fields,
    parse_job_fields,
)
from qworker.service.config import ServiceConfig
from qworker.service.job import Entry, RawFields, Readback, now_ms
from qworker.service.scripts import Scripts

MAX_REASON_CHARS = 1_000


@dataclass
class Reject:
    """An entry that will not run: acked, dead-lettered, and an error event when `job_id`."""

    entry: Entry
    code: str
    message: str
    job_id: str | None
    drop_owner: bool = False  # the job's owner hash goes too (we or a dead worker set it)


@dataclass
class Taken:
    """A job now owned by this worker, with what its output stream already holds."""

    entry: Entry
    job: Job
    readback: Readback
    cancelled: bool
    t0_ms: int
    started_ms: int


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(stream: str, items: Iterable[tuple[Any, Any]] | None) -> list[Entry]:
    return [Entry(stream, _s(eid), dict(fields))
            for eid, fields in items or () if fields is not None]


class Intake:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig, scripts: Scripts,
                 token: str) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.scripts = scripts
        self.token = token
        self._cursors = dict.fromkeys(keys.streams, "0-0")

    @property
    def consumer(self) -> str:
        return self.config.name

    def ensure_group(self) -> None:
        for stream in self.keys.streams:
            try:
                self.client.xgroup_create(stream, self.config.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # ------------------------------------------------------------------ reading

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` new entries, `<prefix>:requeue` first. Blocks (`block_ms`) only when
        nothing is there and the caller is idle."""
        entries: list[Entry] = []
        for stream in self.keys.streams:
            want = count - len(entries)
            if want <= 0:
                break
            reply = self.client.xreadgroup(self.config.group, self.consumer, {stream: ">"},
                                           count=want)
            entries += self._parse_read(reply)
        if not entries and block_ms and count > 0:
            streams = dict.fromkeys(self.keys.streams, ">")
            reply = self.client.xreadgroup(self.config.group, self.consumer, streams, count=1,
                                           block=block_ms)
            entries += self._parse_read(reply)
        return entries

    @staticmethod
    def _parse_read(reply: Any) -> list[Entry]:
        out: list[Entry] = []
        for stream, items in reply or ():
            out += _entries(_s(stream), items)
        return out

    def reclaim(self, count: int, skip_entry_ids: set[str]) -> list[Entry]:
        """XAUTOCLAIM up to `count` entries idle longer than claim_idle (their worker died), with
        their delivery counts. Entries deleted from the stream while pending are acked."""
        entries: list[Entry] = []
        for stream in self.keys.streams:
            want = count - len(entries)
            if want <= 0:
                break
            nxt, items, deleted = self.client.xautoclaim(
                stream, self.config.group, self.consumer, self.config.claim_idle_ms,
                start_id=self._cursors[stream], count=want)[:3]
            self._cursors[stream] = _s(nxt)
            if deleted:
                self.client.xack(stream, self.config.group, *deleted)
            entries += [e for e in _entries(stream, items) if e.entry_id not in skip_entry_ids]
        if entries:
            self._count_deliveries(entries)
        for entry in entries:
            entry.reclaimed = True
        return entries

    def _count_deliveries(self, entries: Sequence[Entry]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for e in entries:
            pipe.xpending_range(e.stream, self.config.group, min=e.entry_id, max=e.entry_id,
                                count=1)
        for entry, info in zip(entries, pipe.execute(), strict=True):
            if info:
                entry.deliveries = int(info[0]["times_delivered"])

    # ------------------------------------------------------------------ screening

    def screen(self, entries: Iterable[Entry], busy_job_ids: set[str]
               ) -> tuple[list[tuple[Entry, Job]], list[Reject]]:
        """Split entries into runnable jobs and rejects (poison, invalid, duplicate, expired)."""
        good: list[tuple[Entry, Job]] = []
        rejects: list[Reject] = []
        now = now_ms()
        for entry in entries:
            try:
                job = parse_job_fields(entry.fields, entry.entry_id)
            except JobValidationError as exc:
                if entry.deliveries > self.config.max_deliveries:
                    rejects.append(self._poison(entry, exc.job_id))
                else:
                    rejects.append(Reject(entry, exc.code, exc.message, exc.job_id))
                continue
            job_id = job.id or entry.entry_id
            if entry.deliveries > self.config.max_deliveries:
                rejects.append(self._poison(entry, job_id))
            elif job_id in busy_job_ids:
                rejects.append(Reject(entry, INVALID_REQUEST,
                                      f"duplicate: job {job_id} is already running here", None))
            elif job.deadline_ms is not None and job.deadline_ms < now:
                rejects.append(Reject(entry, EXPIRED,
                                      f"deadline_ms {job.deadline_ms} passed before it ran",
                                      job_id, drop_owner=entry.reclaimed))
            else:
                busy_job_ids.add(job_id)
                good.append((entry, job))
        return good, rejects

    def _poison(self, entry: Entry, job_id: str | None) -> Reject:
        return Reject(entry, TOO_MANY_DELIVERIES,
                      f"delivered {entry.deliveries} times (max_deliveries "
                      f"{self.config.max_deliveries}); its workers kept dying", job_id,
                      drop_owner=True)

    # ------------------------------------------------------------------ taking

    def take(self, items: Sequence[tuple[Entry, Job]]) -> list[Taken]:
        """Become each job's owner (fencing out any earlier one), then read back its stream and
        cancel flag; one round trip."""
        pipe = self.client.pipeline(transaction=False)
        now = now_ms()
        for entry, job in items:
            job_id = job.id or entry.entry_id
            owner = self.keys.owner(job_id)
            pipe.hset(owner, "worker", self.token)
            pipe.hsetnx(owner, "t0", entry_ms(entry.entry_id) or now)
            pipe.hsetnx(owner, "started", now)
            pipe.expire(owner, self.config.owner_ttl_s)
            pipe.hmget(owner, ["t0", "started"])
            pipe.exists(self.keys.cancel(job_id))
            pipe.xrange(self.keys.out(job_id), "-", "+")
        replies = pipe.execute()
        taken = []
        for k, (entry, job) in enumerate(items):
            t0, started = replies[7 * k + 4]
            taken.append(Taken(entry, job, Readback.parse(replies[7 * k + 6]),
                               cancelled=bool(replies[7 * k + 5]),
                               t0_ms=int(t0 or now), started_ms=int(started or now)))
        return taken

    def ack(self, entries: Iterable[Entry]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for e in entries:
            pipe.xack(e.stream, self.config.group, e.entry_id)
            pipe.xdel(e.stream, e.entry_id)
        pipe.execute()

    # ------------------------------------------------------------------ dead letters

    def dead_letter(self, rejects: Sequence[Reject]) -> None:
        """Ack each reject and, if it was still pending, add a `<prefix>:dead` entry (original
        fields + reason) and the job's error event; one round trip, safe to retry."""
        if not rejects:
            return
        pipe = self.client.pipeline(transaction=False)
        for r in rejects:
            self._queue_dead_letter(pipe, r)
        try:
            pipe.execute()
        except redis.exceptions.NoScriptError:
            Scripts.load(self.client)
            pipe = self.client.pipeline(transaction=False)
            for r in rejects:
                self._queue_dead_letter(pipe, r)
            pipe.execute()

    def _queue_dead_letter(self, pipe: redis.client.Pipeline, r: Reject) -> None:
        message = r.message[:MAX_REASON_CHARS]
        fields = dead_fields(r.entry, r.code, message, self.config.name)
        out = self.keys.out(r.job_id) if r.job_id else None
        error = event_to_fields(ErrorEvent(code=r.code, message=message))
        owner = self.keys.owner(r.job_id) if r.job_id and r.drop_owner else None
        self.scripts.dead_letter(pipe, source=r.entry.stream, dead=self.keys.dead,
                                 group=self.config.group, entry_id=r.entry.entry_id,
                                 ttl_s=self.config.result_ttl, dead_fields=fields, out=out,
                                 error_fields=error, owner=owner)


def dead_fields(entry: Entry, code: str, reason: str, worker: str) -> RawFields:
    """A dead-letter entry: reason, code, source stream and entry, worker, then the original
    fields (one named like a meta field is kept as `original.<name>`)."""
    meta = dict(zip(DEAD_META_FIELDS, (reason, code, entry.stream, entry.entry_id, worker),
                    strict=True))
    fields: RawFields = {k.encode(): v.encode() for k, v in meta.items()}
    for key, value in entry.fields.items():
        k = key if isinstance(key, bytes) else str(key).encode()
        if k in fields:
            k = b"original." + k
        fields[k] = value if isinstance(value, bytes) else str(value).encode()
    return fields
