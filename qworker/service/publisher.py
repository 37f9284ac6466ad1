"""Publisher: one pipelined round trip per engine step for every job's new events, requeues, the
cancel flags of running jobs and, while the engine runs, the new entries it has room for.

All jobs' events go in one `append` call. When Redis answers that call with an error that may be
one job's (a foreign key of the wrong type, an ACL on a job's keys), the jobs are appended again one
call each (the script is idempotent), so the culprit is found and only it fails (`FAILED`).
What a flush answers, per job, is `outcome.FlushResult`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from qworker.service.config import ServiceConfig
from qworker.service.errors import CannotWork, job_error
from qworker.service.event_fields import event_fields
from qworker.service.intake import capped_entries
from qworker.service.job import ActiveJob, Entry
from qworker.service.lease import AppendLease
from qworker.service.outcome import DONE as DONE  # the statuses of a flush, where tests look
from qworker.service.outcome import FAILED as FAILED
from qworker.service.outcome import FENCED, LOST_STATE, OK, REQUEUED, TERMINAL, FlushResult
from qworker.service.outcome import GAP as GAP
from qworker.service.recent import Recent
from qworker.service.scripts import JobAppend, Lease, Scripts, decode_status
from qworker.service.usage import Usage
from qworker_client.protocol import Keys, TokenEvent, band_of

# the requeue script's replies (a retry finds the job released: requeued before)
REQUEUE_STATUS = {"ok": REQUEUED, "fenced": FENCED, "terminal": TERMINAL, "lost_state": LOST_STATE}

class Publisher:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig, scripts: Scripts,
                 token: str) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.scripts = scripts
        self.token = token
        self.recent = Recent(client, keys, config)
        self.usage = Usage(client, keys, config)
        self.lease = AppendLease(keys, token, config.liveness_ttl_ms)

    def flush(self, jobs: Sequence[ActiveJob], cancel_check: Sequence[str],
              read_caps: Sequence[tuple[str, int]] = (),
              on_read: Callable[[list[Entry]], None] = lambda entries: None) -> FlushResult:
        """Write every outbox, requeue what asks for it, read the cancel flags of `cancel_check`
        and the new entries `read_caps` allow (`Intake.caps`), handed to `on_read` as soon as
        they are read (the heartbeat keeps them owned from then on). Everything written is
        idempotent, so after a connection error the caller just retries (entries read by a round
        trip whose reply is lost stay pending to this consumer, for a reclaim)."""
        try:
            result = self._flush(jobs, cancel_check, read_caps)
        except redis.exceptions.NoScriptError:
            Scripts.load(self.client)  # Redis restarted (or flushed its script cache)
            result = self._flush(jobs, cancel_check, read_caps)
        on_read(result.entries)
        self.lease.keep_only([*(job.job_id for job in jobs if job.in_engine), *cancel_check])
        self.recent.add(jobs, result.status)
        self.usage.add(jobs, result.status)
        return result

    def _flush(self, jobs: Sequence[ActiveJob], cancel_check: Sequence[str],
               read_caps: Sequence[tuple[str, int]]) -> FlushResult:
        pipe = self.client.pipeline(transaction=False)
        appending = [job for job in jobs if job.outbox]
        requeueing = [job for job in jobs if job.requeue]
        lease = self.lease.next_call()
        if appending:
            self._append(pipe, appending, lease)
        for job in requeueing:
            self._requeue(pipe, job)
        if cancel_check:
            # MGET by name: a Cluster's pipeline refuses `mget`, though these keys share a slot
            pipe.execute_command("MGET", *(self.keys.cancel(job_id) for job_id in cancel_check))
        if read_caps:
            self.scripts.read(pipe, group=self.config.group, consumer=self.config.name,
                              caps=read_caps, fair=self.keys if self.config.fair_share else None)
        result = FlushResult()
        if not appending and not requeueing and not cancel_check and not read_caps:
            return result
        replies = pipe.execute(raise_on_error=False)
        if read_caps:  # first: whatever else failed, these entries are ours now
            read = replies.pop()
            if isinstance(read, redis.exceptions.NoScriptError):
                raise read
            if isinstance(read, Exception):
                result.error = read  # the worker's own phase: not one job's
            else:
                result.entries = capped_entries(read, self.keys)
        try:
            self._statuses(appending, requeueing, cancel_check, iter(replies), result, lease)
        except redis.exceptions.NoScriptError:
            raise
        except (redis.RedisError, CannotWork) as exc:
            result.error = exc
        return result

    def _statuses(self, appending: Sequence[ActiveJob], requeueing: Sequence[ActiveJob],
                  cancel_check: Sequence[str], replies: Iterator[Any], result: FlushResult,
                  lease: Lease) -> None:
        if appending:
            self._append_statuses(appending, next(replies), result, lease)
        for job in requeueing:
            reply = next(replies)
            error = job_error(reply)
            if result.status.get(job.job_id, OK) != OK:
                continue  # the append's outcome (done, fenced, lost_state, ...) comes first
            if error is not None:
                result.fail(job.job_id, error)
            else:
                result.status[job.job_id] = REQUEUE_STATUS[decode_status(reply)]
        if cancel_check:
            flags = next(replies)
            if isinstance(flags, Exception):
                raise flags  # the worker's own phase: not one job's
            pairs = zip(cancel_check, flags, strict=True)
            result.cancelled = {job_id for job_id, flag in pairs if flag is not None}

    def _append_statuses(self, jobs: Sequence[ActiveJob], reply: list[Any] | Exception,
                         result: FlushResult, lease: Lease) -> None:
        error = job_error(reply)  # raises what is not these jobs' error
        if not isinstance(reply, Exception):
            statuses, takeovers, trusted = reply
            status = {job.job_id: decode_status(one)
                      for job, one in zip(jobs, statuses, strict=True)}
            result.status.update(status)
            self.lease.answered(lease, _str(takeovers), bool(trusted), status,
                                {job.job_id: _next_index(job) for job in jobs})
            return
        self.lease.unknown()  # what the calls below (or the failed one) set is not known
        if len(jobs) == 1:
            result.fail(jobs[0].job_id, str(error))
            return
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            self._append(pipe, [job], self.lease.next_call())
        for job, one in zip(jobs, pipe.execute(raise_on_error=False), strict=True):
            error = job_error(one)
            if error is not None:
                result.fail(job.job_id, error)
            else:
                result.status[job.job_id] = decode_status(one[0][0])

    def _append(self, pipe: redis.client.Pipeline, jobs: Sequence[ActiveJob],
                lease: Lease) -> None:
        appends = []
        for job in jobs:
            ttl_s = self.config.result_ttl_of(job.job)
            appends.append(JobAppend(
                self.keys.out(job.job_id), self.keys.owner(job.job_id), job.entry.stream,
                job.entry.entry_id, [event_fields(e) for e in job.outbox], ttl_s,
                trusted=self.lease.trusted(job.job_id, _first_index(job)),
                refresh_s=self.lease.refresh_s(job.job_id, ttl_s)))
        self.scripts.append(pipe, token=self.token, group=self.config.group, jobs=appends,
                            lease=lease)

    def _requeue(self, pipe: redis.client.Pipeline, job: ActiveJob) -> None:
        fields = dict(job.entry.fields)
        if b"id" not in fields:  # the job id defaulted to the entry id: keep it
            fields[b"id"] = job.job_id.encode()
        # back to its model's requeue stream (only the workers of its model resume it), of its
        # priority's band
        requeue = self.keys.requeue_of(self.keys.stream_model(job.entry.stream),
                                       band_of(job.job.priority))
        self.scripts.requeue(pipe, owner=self.keys.owner(job.job_id), source=job.entry.stream,
                             requeue=requeue, out=self.keys.out(job.job_id), token=self.token,
                             group=self.config.group, entry_id=job.entry.entry_id,
                             ttl_s=self.config.result_ttl_of(job.job), fields=fields)


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _first_index(job: ActiveJob) -> int | None:
    return next((e.i for e in job.outbox if isinstance(e, TokenEvent)), None)


def _next_index(job: ActiveJob) -> int:
    """The index after the last token of `job`'s outbox (its next index when it has none)."""
    last = next((e.i for e in reversed(job.outbox) if isinstance(e, TokenEvent)), None)
    return job.next_index if last is None else last + 1
