"""Publisher: one pipelined round trip per engine step for every job's new events, requeues, the
cancel flags of running jobs and, while the engine runs, the new entries it has room for.

All jobs' events go in one `append` call. When Redis answers that call with an error that may be
one job's (a foreign key of the wrong type, an ACL on a job's keys), the jobs are appended again one
call each (the script is idempotent), so the culprit is found and only it fails (`FAILED`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from qworker.service.config import ServiceConfig
from qworker.service.errors import job_error
from qworker.service.event_fields import event_fields
from qworker.service.intake import capped_entries
from qworker.service.job import ActiveJob, Entry
from qworker.service.scripts import JobAppend, Scripts, decode_status
from qworker_client.protocol import Keys, band_of

# Outcome of a flush, per job id:
OK = "ok"  # events written (or already there); the job goes on
DONE = "done"  # terminal event written, entry acked
TERMINAL = "terminal"  # the stream was already finished (entry acked): drop the job
LOST = "lost"  # another worker owns the job now: drop it, do not ack
GAP = "gap"  # our next token is not the stream's next index: drop it, it will be reclaimed
REQUEUED = "requeued"  # requeued (or, on a retry, found already requeued)
FAILED = "failed"  # Redis refused this job's keys (see FlushResult.errors): fail the job alone


@dataclass
class FlushResult:
    status: dict[str, str] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)  # job id -> Redis' reply, when FAILED
    entries: list[Entry] = field(default_factory=list)  # read, when the flush was given caps

    def fail(self, job_id: str, error: str) -> None:
        self.status[job_id] = FAILED
        self.errors[job_id] = error


class Publisher:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig, scripts: Scripts,
                 token: str) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.scripts = scripts
        self.token = token

    def flush(self, jobs: Sequence[ActiveJob], cancel_check: Sequence[str],
              read_caps: Sequence[tuple[str, int]] = ()) -> FlushResult:
        """Write every outbox, requeue what asks for it, read the cancel flags of `cancel_check`
        and the new entries `read_caps` allow (`Intake.caps`). Everything written is idempotent,
        so after a connection error the caller just retries (entries read by a round trip whose
        reply is lost stay pending to this consumer, for a reclaim)."""
        try:
            return self._flush(jobs, cancel_check, read_caps)
        except redis.exceptions.NoScriptError:
            Scripts.load(self.client)  # Redis restarted (or flushed its script cache)
            return self._flush(jobs, cancel_check, read_caps)

    def _flush(self, jobs: Sequence[ActiveJob], cancel_check: Sequence[str],
               read_caps: Sequence[tuple[str, int]]) -> FlushResult:
        pipe = self.client.pipeline(transaction=False)
        appending = [job for job in jobs if job.outbox]
        requeueing = [job for job in jobs if job.requeue]
        if appending:
            self._append(pipe, appending)
        for job in requeueing:
            self._requeue(pipe, job)
        if cancel_check:
            pipe.mget([self.keys.cancel(job_id) for job_id in cancel_check])
        if read_caps:
            self.scripts.read(pipe, group=self.config.group, consumer=self.config.name,
                              caps=read_caps)
        result = FlushResult()
        if not appending and not requeueing and not cancel_check and not read_caps:
            return result
        replies = iter(pipe.execute(raise_on_error=False))
        if appending:
            self._append_statuses(appending, next(replies), result)
        for job in requeueing:
            error = job_error(next(replies))  # ok, or lost: either way it is no longer ours
            if error is not None and job.job_id not in result.status:
                result.fail(job.job_id, error)
            elif result.status.get(job.job_id) not in (TERMINAL, LOST, GAP, DONE, FAILED):
                result.status[job.job_id] = REQUEUED
        if cancel_check:
            flags = next(replies)
            if isinstance(flags, Exception):
                raise flags  # the worker's own phase: not one job's
            pairs = zip(cancel_check, flags, strict=True)
            result.cancelled = {job_id for job_id, flag in pairs if flag is not None}
        if read_caps:
            read = next(replies)
            if isinstance(read, Exception):
                raise read  # the worker's own phase, as the cancel flags
            result.entries = capped_entries(read)
        return result

    def _append_statuses(self, jobs: Sequence[ActiveJob], reply: list[Any] | Exception,
                         result: FlushResult) -> None:
        error = job_error(reply)  # raises what is not these jobs' error
        if not isinstance(reply, Exception):
            for job, status in zip(jobs, reply, strict=True):
                result.status[job.job_id] = decode_status(status)
            return
        if len(jobs) == 1:
            result.fail(jobs[0].job_id, str(error))
            return
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            self._append(pipe, [job])
        for job, one in zip(jobs, pipe.execute(raise_on_error=False), strict=True):
            error = job_error(one)
            if error is not None:
                result.fail(job.job_id, error)
            else:
                result.status[job.job_id] = decode_status(one[0])

    def _append(self, pipe: redis.client.Pipeline, jobs: Sequence[ActiveJob]) -> None:
        self.scripts.append(pipe, token=self.token, ttl_s=self.config.result_ttl,
                            group=self.config.group, jobs=[
                                JobAppend(self.keys.out(job.job_id), self.keys.owner(job.job_id),
                                          job.entry.stream, job.entry.entry_id,
                                          [event_fields(e) for e in job.outbox])
                                for job in jobs])

    def _requeue(self, pipe: redis.client.Pipeline, job: ActiveJob) -> None:
        fields = dict(job.entry.fields)
        if b"id" not in fields:  # the job id defaulted to the entry id: keep it
            fields[b"id"] = job.job_id.encode()
        # back to its model's requeue stream (only the workers of its model resume it), of its
        # priority's band
        requeue = self.keys.requeue_of(self.keys.stream_model(job.entry.stream),
                                       band_of(job.job.priority))
        self.scripts.requeue(pipe, owner=self.keys.owner(job.job_id), source=job.entry.stream,
                             requeue=requeue, token=self.token, group=self.config.group,
                             entry_id=job.entry.entry_id, fields=fields)
