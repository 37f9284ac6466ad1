"""What a round trip (`Publisher.flush`) answers: per job, how its writes went; the cancel flags
it read; the entries it read for intake; a worker-wide error found after the writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from qworker.service.job import Entry

# Outcome of a flush, per job id:
OK = "ok"  # events written (or already there); the job goes on
DONE = "done"  # terminal event written, entry acked
TERMINAL = "terminal"  # the stream was already finished (entry acked): drop the job
FENCED = "fenced"  # another worker owns the job now: drop it, do not ack
LOST_STATE = "lost_state"  # its owner hash is gone (Redis forgot it): ended with lost_state
GAP = "gap"  # our next token is not the stream's next index: drop it, it will be reclaimed
REQUEUED = "requeued"  # requeued (or, on a retry, found already requeued)
FAILED = "failed"  # Redis refused this job's keys (see FlushResult.errors): fail the job alone


@dataclass
class FlushResult:
    status: dict[str, str] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)  # job id -> Redis' reply, when FAILED
    entries: list[Entry] = field(default_factory=list)  # read, when the flush was given caps
    # a worker-wide error (transient, group gone, cannot work) found after the writes: what the
    # reply says of each job and the entries read still count; the caller raises it after them
    error: Exception | None = None

    def fail(self, job_id: str, error: str) -> None:
        self.status[job_id] = FAILED
        self.errors[job_id] = error
