"""A job's status from Redis alone (docs/protocol.md, "Asking a job's status"): queued, running,
done, error or unknown, with its result when it has ended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import redis
import redis.asyncio

from qworker_client.protocol import DoneEvent, ErrorEvent, Keys, TokenEvent, parse_event
from qworker_client.result import Result, result_fields

Status = Literal["queued", "running", "done", "error", "unknown"]


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    status: Status
    result: Result | None = None  # when done
    error: ErrorEvent | None = None  # when error

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.job_id, "status": self.status}
        if self.result is not None:
            out["result"] = {k: v for k, v in result_fields(self.result).items()
                             if k != "job_id"}
        if self.error is not None:
            out["error"] = {"code": self.error.code, "message": self.error.message}
        return out


def job_status(client: redis.Redis, keys: Keys, job_id: str) -> JobStatus:
    pipe = client.pipeline(transaction=False)
    _queue_reads(pipe, keys, job_id)
    return _status(job_id, *pipe.execute())


async def job_status_async(client: redis.asyncio.Redis, keys: Keys, job_id: str) -> JobStatus:
    pipe = client.pipeline(transaction=False)
    _queue_reads(pipe, keys, job_id)
    return _status(job_id, *await pipe.execute())


def _queue_reads(pipe: Any, keys: Keys, job_id: str) -> None:
    """The last output event, whether a worker owns the job, whether it was submitted."""
    pipe.xrevrange(keys.out(job_id), count=1)
    pipe.exists(keys.owner(job_id))
    pipe.exists(keys.submitted(job_id))


def _status(job_id: str, last: list[Any], owned: int, marked: int) -> JobStatus:
    if last:
        event = parse_event(last[0][1])
        if isinstance(event, DoneEvent):
            return JobStatus(job_id, "done", result=Result.from_done(job_id, event))
        if isinstance(event, ErrorEvent):
            return JobStatus(job_id, "error", error=event)
        assert isinstance(event, TokenEvent)
        return JobStatus(job_id, "running")
    if owned:
        return JobStatus(job_id, "running")
    return JobStatus(job_id, "queued" if marked else "unknown")
