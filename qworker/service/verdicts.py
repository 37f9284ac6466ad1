"""Whether a job just taken may run, by rules that need neither Redis nor the engine: its start
deadlines, and the poison rule (docs/operating.md, "Poison jobs")."""

from __future__ import annotations

from qworker.service.job import Reject, Taken
from qworker_client.protocol import EXPIRED, TOO_MANY_DELIVERIES


def expired(t: Taken, now_ms: int) -> Reject | None:
    """Past its start deadline (`deadline_ms`, or `start_within_ms` after it was first queued)
    and never started by anyone: not run. A job that started (drained, preempted, reclaimed) is
    resumed whatever the time."""
    job = t.job
    if t.started_before:
        return None
    if job.deadline_ms is not None and job.deadline_ms < now_ms:
        why = f"deadline_ms {job.deadline_ms} passed before it started"
    elif job.start_within_ms is not None and t.t0_ms + job.start_within_ms < now_ms:
        why = (f"not started within start_within_ms {job.start_within_ms} of its queueing "
               f"(waited {now_ms - t.t0_ms} ms)")
    else:
        return None
    return Reject(t.entry, EXPIRED, why, t.job_id, drop_owner=True, job=job)


def poisoned(t: Taken, max_crashes: int, max_deliveries: int) -> Reject | None:
    """A poison job: its workers died (or stalled) `max_crashes` times while they ran it alone;
    or, last resort, delivered more than `max_deliveries` times not counting the deliveries
    after a death already charged to a job (itself or another). So the jobs that merely shared a
    batch or a worker with a poison job are never charged for it."""
    if t.crashes >= max_crashes:
        return Reject(t.entry, TOO_MANY_DELIVERIES,
                      f"its worker died {t.crashes} times while it ran this job alone "
                      f"(max_crashes {max_crashes}): a poison job", t.job_id, drop_owner=True,
                      job=t.job)
    deliveries = t.entry.deliveries - t.excused - t.crashes
    if deliveries > max_deliveries:
        return Reject(t.entry, TOO_MANY_DELIVERIES,
                      f"delivered {deliveries} times (max_deliveries {max_deliveries}; not "
                      f"counted: {t.crashes} after a crash of its own, {t.excused} after another "
                      f"job's); its workers kept dying or stalling", t.job_id, drop_owner=True,
                      job=t.job)
    return None
