"""Publisher: one pipelined round trip per engine step for every job's new events, requeues and
the cancel flags of running jobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from qworker.protocol import Keys, event_to_fields
from qworker.service.config import ServiceConfig
from qworker.service.job import ActiveJob
from qworker.service.scripts import Scripts, decode_status

# Outcome of a flush, per job id:
OK = "ok"  # events written (or already there); the job goes on
DONE = "done"  # terminal event written, entry acked
TERMINAL = "terminal"  # the stream was already finished (entry acked): drop the job
LOST = "lost"  # another worker owns the job now: drop it, do not ack
GAP = "gap"  # our next token is not the stream's next index: drop it, it will be reclaimed
REQUEUED = "requeued"  # requeued (or, on a retry, found already requeued)


@dataclass
class FlushResult:
    status: dict[str, str] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)


class Publisher:
    def __init__(self, client: redis.Redis, keys: Keys, config: ServiceConfig, scripts: Scripts,
                 token: str) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self.scripts = scripts
        self.token = token

    def flush(self, jobs: Sequence[ActiveJob], cancel_check: Sequence[str]) -> FlushResult:
        """Write every outbox, requeue what asks for it, read the cancel flags of `cancel_check`.
        Everything written is idempotent, so after a connection error the caller just retries."""
        try:
            return self._flush(jobs, cancel_check)
        except redis.exceptions.NoScriptError:
            Scripts.load(self.client)  # Redis restarted (or flushed its script cache)
            return self._flush(jobs, cancel_check)

    def _flush(self, jobs: Sequence[ActiveJob], cancel_check: Sequence[str]) -> FlushResult:
        pipe = self.client.pipeline(transaction=False)
        ops: list[tuple[str, str]] = []
        for job in jobs:
            if job.outbox:
                self._append(pipe, job)
                ops.append((job.job_id, "append"))
            if job.requeue:
                self._requeue(pipe, job)
                ops.append((job.job_id, "requeue"))
        if cancel_check:
            pipe.mget([self.keys.cancel(job_id) for job_id in cancel_check])
        result = FlushResult()
        if not ops and not cancel_check:
            return result
        replies = pipe.execute()
        for (job_id, op), reply in zip(ops, replies[:len(ops)], strict=True):
            status = decode_status(reply)
            if op == "requeue":
                status = REQUEUED  # ok, or lost: either way it is no longer ours
                if result.status.get(job_id) in (TERMINAL, LOST, GAP, DONE):
                    continue
            result.status[job_id] = status
        if cancel_check:
            flags = replies[len(ops)]
            pairs = zip(cancel_check, flags, strict=True)
            result.cancelled = {job_id for job_id, flag in pairs if flag is not None}
        return result

    def _append(self, pipe: redis.client.Pipeline, job: ActiveJob) -> None:
        self.scripts.append(pipe, out=self.keys.out(job.job_id), owner=self.keys.owner(job.job_id),
                            source=job.entry.stream, token=self.token,
                            ttl_s=self.config.result_ttl, group=self.config.group,
                            entry_id=job.entry.entry_id,
                            events=[event_to_fields(e) for e in job.outbox])

    def _requeue(self, pipe: redis.client.Pipeline, job: ActiveJob) -> None:
        fields = dict(job.entry.fields)
        if b"id" not in fields:  # the job id defaulted to the entry id: keep it
            fields[b"id"] = job.job_id.encode()
        self.scripts.requeue(pipe, owner=self.keys.owner(job.job_id), source=job.entry.stream,
                             requeue=self.keys.requeue, token=self.token, group=self.config.group,
                             entry_id=job.entry.entry_id, fields=fields)
